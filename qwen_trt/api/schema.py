"""``/openapi.json``: the request and response bodies this server really takes and sends, as
pydantic models (documentation only: requests are checked by :mod:`qwen_trt.api.protocol`,
which gives OpenAI-shaped 400s, and the handlers build their replies as plain dicts)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, RootModel

from qwen_trt.api.protocol import MAX_STOP_IDS, MAX_STOPS

Open = ConfigDict(extra="allow")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


Content = Union[str, list[TextPart]]
# A token id: 0..vocab-1 (the bound is the served tokenizer's, filled in by build_openapi).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str = Field(description="The arguments as a JSON object, as text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class HistoryFunctionCall(BaseModel):
    model_config = Open
    name: str = Field(min_length=1)
    arguments: Union[str, dict[str, Any]] = Field(
        "{}", description="The arguments as a JSON object, or as its text.")


class HistoryToolCall(BaseModel):
    """A call in an earlier assistant message: the function is what counts."""
    model_config = Open
    id: Any = Field(None, description="Kept when a string, else call_<index>.")
    type: Any = Field(None, description="Ignored (every call is a function call).")
    function: HistoryFunctionCall


class SystemMessage(BaseModel):
    model_config = Open
    role: Literal["system", "developer"]
    content: Content
    name: Any = Field(None, description="Ignored (the chat template has no place for it).")


class UserMessage(BaseModel):
    model_config = Open
    role: Literal["user"]
    content: Content
    name: Any = Field(None, description="Ignored (the chat template has no place for it).")


class AssistantHistoryMessage(BaseModel):
    """An earlier reply: its text, its tool calls, or both (content may be null)."""
    model_config = Open
    role: Literal["assistant"]
    content: Optional[Content] = None
    # an empty object counts as no calls (as the server reads it: protocol._empty)
    tool_calls: Union[list[HistoryToolCall], Annotated[dict[str, Any], Field(max_length=0)],
                      None] = None
    name: Any = Field(None, description="Ignored (the chat template has no place for it).")


class ToolMessage(BaseModel):
    model_config = Open
    role: Literal["tool"]
    content: Content
    tool_call_id: Optional[str] = None


# Which fields a message needs depends on its role, as the server checks them
# (qwen_trt.api.protocol.parse_messages): every role but assistant needs its content.
Message = Annotated[Union[SystemMessage, UserMessage, AssistantHistoryMessage, ToolMessage],
                    Field(discriminator="role")]


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = Open
    name: str


class NamedTool(BaseModel):
    """A function of ``tools``, by name (a name not in ``tools`` is a 400)."""
    model_config = Open
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(BaseModel):
    mode: Literal["auto", "required"]
    tools: list[NamedTool] = Field(min_length=1, description="Functions of ``tools``.")


class AllowedToolsChoice(BaseModel):
    model_config = Open
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class JsonSchemaFormat(BaseModel):
    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class PlainFormat(BaseModel):
    type: Literal["text", "json_object"]
    json_schema: Any = Field(None, description="Ignored with these types.")


class SchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Union[PlainFormat, SchemaFormat], Field(discriminator="type")]


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


# The context limit (max_model_len), filled in by build_openapi: prompt + max_tokens must fit it.
ContextBound = {"x-context": True}


class Sampling(BaseModel):
    model_config = Open
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1, json_schema_extra=ContextBound, description=(
        "At most max_model_len - 1; the prompt's tokens plus this must fit max_model_len "
        "(else a 400, code context_length_exceeded)."))
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    seed: Optional[int] = Field(None, ge=0, le=2 ** 64 - 1)
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOPS)], None] = None
    stop_token_ids: Optional[Annotated[list[Annotated[int, Field(ge=0)]],
                                       Field(max_length=MAX_STOP_IDS)]] = None
    n: Optional[int] = Field(None, ge=1, le=8)
    ignore_eos: Optional[bool] = None


# top_logprobs of 1 or more needs logprobs: true
_TOP_NEEDS_LOGPROBS = {
    "if": {"required": ["top_logprobs"],
           "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class ChatCompletionRequest(Sampling):
    model_config = ConfigDict(extra="allow", json_schema_extra=_TOP_NEEDS_LOGPROBS)
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, json_schema_extra=ContextBound)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedTool, AllowedToolsChoice,
                       None] = Field(None, description=(
        "A named function, and allowed_tools' functions, must be in tools; 'required' needs "
        "tools."))
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None  # noqa: UP007
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


NonEmpty = Annotated[str, Field(min_length=1)]


class CompletionRequest(Sampling):
    prompt: Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=64)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                            Field(min_length=1, max_length=64)]] = Field(
        description="Text (not empty), up to 64 texts, token ids, or up to 64 lists of them.")
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[Literal[False]] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]]
    refusal: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    refusal: Optional[str]
    tool_calls: Optional[list[ToolCall]] = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs]
    finish_reason: FinishReason


class PromptDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptDetails] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: dict[str, str]


class ChunkDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: Optional[ChoiceLogprobs]
    finish_reason: Optional[FinishReason]


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[LegacyLogprobs]
    finish_reason: Optional[Literal["stop", "length"]]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TokenizePrompt(BaseModel):
    """Text to tokenise (and no ``messages``: those win when both are sent)."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"not": {"required": ["messages"]}})
    model: Optional[str] = None
    prompt: str
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = None


class TokenizeMessages(BaseModel):
    """Chat messages to lay out with the chat template, then tokenise."""
    model_config = Open
    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    add_generation_prompt: Optional[bool] = None
    return_token_strs: Optional[bool] = None


class TokenizeRequest(RootModel[Union[TokenizePrompt, TokenizeMessages]]):
    """Either ``prompt`` or ``messages``."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]]


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- the Responses and Messages APIs (qwen_trt.api.responses, qwen_trt.api.messages) ----------
class ResponsesFunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class CreateResponseRequest(BaseModel):
    model_config = Open
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]] = Field(
        description="A string, or message / function_call / function_call_output items (text).")
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = Field(None, description="{'format': text | json_object | "
                                                             "json_schema}")
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    max_output_tokens: Optional[int] = Field(None, ge=1)
    store: Optional[bool] = None
    stream: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None


class ResponseObject(BaseModel):
    model_config = Open
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: Optional[dict[str, Any]] = None


class ResponseItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    has_more: bool
    first_id: Optional[str]
    last_id: Optional[str]


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class MessagesRequest(BaseModel):
    model_config = Open
    model: Optional[str] = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)


class AnthropicMessage(BaseModel):
    model_config = Open
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]]
    stop_sequence: Optional[str]
    usage: dict[str, int]


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


# path -> (method, request model, 200 model, whether it streams)
ROUTES = {
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    "/v1/completions": ("post", CompletionRequest, Completion, Completion),
    "/v1/models": ("get", None, ModelList, None),
    "/v1/models/{model_id}": ("get", None, Model, None),
    "/tokenize": ("post", TokenizeRequest, TokenizeResponse, None),
    "/detokenize": ("post", DetokenizeRequest, DetokenizeResponse, None),
}
# the Responses and Messages routes: (path, method, request, 200 model, stream note, error model)
MORE_ROUTES = [
    ("/v1/responses", "post", CreateResponseRequest, ResponseObject,
     "named events ('event: response.created' ... 'response.completed'), no [DONE]", None),
    ("/v1/responses/{response_id}", "get", None, ResponseObject, None, None),
    ("/v1/responses/{response_id}", "delete", None, ResponseDeleted, None, None),
    ("/v1/responses/{response_id}/input_items", "get", None, ResponseItemList, None, None),
    ("/v1/messages", "post", MessagesRequest, AnthropicMessage,
     "Anthropic's named events ('event: message_start' ... 'message_stop')", AnthropicError),
]
MODELS = [ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk,
          Completion, ModelList, Model, ErrorResponse, TokenizeRequest, TokenizeResponse,
          DetokenizeRequest, DetokenizeResponse, CreateResponseRequest, ResponseObject,
          ResponseItemList, ResponseDeleted, MessagesRequest, AnthropicMessage, AnthropicError]


def _ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _bound(node, marker: str, maximum: int | None) -> None:
    """Every schema marked ``marker`` gets ``maximum`` (where known; the marker goes), and an
    ``anyOf`` [integer, null] carries it to its integer branch."""
    if isinstance(node, dict):
        if node.pop(marker, False) and maximum is not None:
            target = next((b for b in node.get("anyOf", ()) if b.get("type") == "integer"), node)
            target["maximum"] = maximum
        for v in node.values():
            _bound(v, marker, maximum)
    elif isinstance(node, list):
        for v in node:
            _bound(v, marker, maximum)


def _limits(app: FastAPI) -> tuple[int | None, int | None]:
    """The largest token id and the largest max_tokens this server can take."""
    try:
        vocab = len(app.state.service.tokenizer) - 1
    except Exception:  # noqa: BLE001 - no tokenizer to ask: the ids stay unbounded above
        vocab = None
    try:
        ctx = int(app.state.service.info.max_seq_len) - 1
    except Exception:  # noqa: BLE001
        ctx = None
    return vocab, ctx


def build_openapi(app: FastAPI) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in MODELS:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                     by_alias=True)
        schemas.update(js.pop("$defs", {}))
        schemas[model.__name__] = js
    vocab, ctx = _limits(app)
    _bound(schemas, "x-token-id", vocab)
    _bound(schemas, "x-context", ctx)
    chat = [(path, method, req, res, None if chunk is None else
             f"'data: <{chunk.__name__} JSON>' lines, then 'data: [DONE]'", None)
            for path, (method, req, res, chunk) in ROUTES.items()]
    for path, method, req, res, stream, err in chat + MORE_ROUTES:
        op = doc.get("paths", {}).get(path, {}).get(method)
        if op is None:
            continue
        op.pop("requestBody", None)
        if req is not None:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": _ref(req)}}}
        content = {"application/json": {"schema": _ref(res)}}
        if stream is not None:
            # one event each (schemathesis reads them so): its data a JSON object, the last
            # one's the text [DONE]
            content["text/event-stream"] = {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                "description": f"Server-sent events: {stream}."}}
        shape = "Anthropic's" if err is AnthropicError else "OpenAI's"
        error = {"description": f"Error ({shape} shape)", "content": {"application/json": {
            "schema": _ref(err or ErrorResponse)}}}
        # the body limit and the request guard answer before any route, in OpenAI's shape
        front = {"description": "Error (OpenAI's shape: the body limit, the request guard)",
                 "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        op["responses"] = {"200": {"description": "OK", "content": content},
                           **{code: error for code in ("400", "401", "404", "503")},
                           **{code: front for code in ("413", "415", "421")}}
    return doc


def describe_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (served at /openapi.json) describe the real bodies."""
    cache: dict = {}

    def openapi() -> dict:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app)
        return cache["doc"]

    app.openapi = openapi
