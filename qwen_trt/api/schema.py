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


# path -> (method, request model, 200 model, whether it streams)
ROUTES = {
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    "/v1/completions": ("post", CompletionRequest, Completion, Completion),
    "/v1/models": ("get", None, ModelList, None),
    "/v1/models/{model_id}": ("get", None, Model, None),
    "/tokenize": ("post", TokenizeRequest, TokenizeResponse, None),
    "/detokenize": ("post", DetokenizeRequest, DetokenizeResponse, None),
}
MODELS = [ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk,
          Completion, ModelList, Model, ErrorResponse, TokenizeRequest, TokenizeResponse,
          DetokenizeRequest, DetokenizeResponse]


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
    error = {"description": "Error (OpenAI's shape)",
             "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    for path, (method, req, res, chunk) in ROUTES.items():
        real = path.replace("{model_id}", "{model_id}")
        op = doc.get("paths", {}).get(real, {}).get(method)
        if op is None:
            continue
        op.pop("requestBody", None)
        if req is not None:
            op["requestBody"] = {"required": True,
                                 "content": {"application/json": {"schema": _ref(req)}}}
        content = {"application/json": {"schema": _ref(res)}}
        if chunk is not None:
            content["text/event-stream"] = {"schema": {
                "type": "string", "description": f"Server-sent events: 'data: <{chunk.__name__}"
                                                 " JSON>' lines, then 'data: [DONE]'."}}
        op["responses"] = {"200": {"description": "OK", "content": content},
                           "400": error, "401": error, "404": error, "503": error}
    return doc


def describe_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (served at /openapi.json) describe the real bodies."""
    cache: dict = {}

    def openapi() -> dict:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app)
        return cache["doc"]

    app.openapi = openapi
