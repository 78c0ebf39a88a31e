"""``/openapi.json``: the request and response bodies this server really takes and sends, as
pydantic models (documentation only: requests are checked by :mod:`qwen_trt.api.protocol`,
which gives OpenAI-shaped 400s, and the handlers build their replies as plain dicts)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

Open = ConfigDict(extra="allow")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


Content = Union[str, list[TextPart], None]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object, as text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = Open
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedTool(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class JsonSchemaFormat(BaseModel):
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class Sampling(BaseModel):
    model_config = Open
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    n: Optional[int] = Field(None, ge=1, le=8)
    ignore_eos: Optional[bool] = None


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedTool, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
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


class TokenizeRequest(BaseModel):
    model_config = Open
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    return_token_strs: Optional[bool] = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]]


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[int]


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


def build_openapi(app: FastAPI) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in MODELS:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                     by_alias=True)
        schemas.update(js.pop("$defs", {}))
        schemas[model.__name__] = js
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
            content["text/event-stream"] = {"schema": {
                "type": "string", "description": f"Server-sent events: {stream}."}}
        shape = "Anthropic's" if err is AnthropicError else "OpenAI's"
        error = {"description": f"Error ({shape} shape)", "content": {"application/json": {
            "schema": _ref(err or ErrorResponse)}}}
        op["responses"] = {"200": {"description": "OK", "content": content},
                           **{code: error for code in ("400", "401", "404", "503")}}
    return doc


def describe_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (served at /openapi.json) describe the real bodies."""
    cache: dict = {}

    def openapi() -> dict:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app)
        return cache["doc"]

    app.openapi = openapi
