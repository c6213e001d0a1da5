"""The answers of each route, described for the OpenAPI schema FastAPI publishes at /openapi.json.

The routes build their bodies as plain dicts (protocol.py); these classes only describe them, so
that clients, and the schemathesis fuzzer in the tests, can check every answer against the schema:
the JSON bodies and their server-sent-event form, and every error status a route can give, each with
OpenAI's error body. Extra fields are allowed everywhere, as OpenAI adds fields over time.
"""

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | int | None
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: Any = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: Any = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class ChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    finish_reason: str | None
    logprobs: Any = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "dead", "draining"]


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string when encoding_format is "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def errors(*statuses: int) -> dict:
    return {status: {"model": ErrorBody} for status in statuses}


def inline(model: type[BaseModel]) -> dict:
    """model's JSON schema with its $defs written in place, to nest inside another schema."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: resolve(value) for key, value in node.items()}
        return [resolve(item) for item in node] if isinstance(node, list) else node

    return resolve(schema)


def events(chunk: type[BaseModel]) -> dict:
    """With "stream": true: server-sent events, each `data: <a chunk as JSON>`; after a fault once the
    stream began, an error body; last, `data: [DONE]` (Open API 3.1: the schema describes one event)."""
    payload = {"anyOf": [inline(chunk), inline(ErrorBody)]}
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                            "contentSchema": payload}]}  # fmt: skip
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}


# 400 bad value, 401 key, 404 model, 408 slow body, 413 big body, 422 bad shape, 500 a fault of this request's
# or the engine died with it inside, 503 engine dead or shutting down, 504 past --request-timeout
GENERATION_ERRORS = errors(400, 401, 404, 408, 413, 422, 500, 503, 504)
CHAT_RESPONSES = {200: {"model": ChatCompletion, "content": events(ChatCompletionChunk)}, **GENERATION_ERRORS}
COMPLETION_RESPONSES = {200: {"model": Completion, "content": events(CompletionChunk)}, **GENERATION_ERRORS}
EMBEDDING_RESPONSES = {200: {"model": EmbeddingList}, **errors(400, 401, 404, 413, 422, 500)}
MODELS_RESPONSES = {200: {"model": ModelList}, **errors(401)}
HEALTH_RESPONSES = {200: {"model": Health}, 503: {"model": Health}}
METRICS_RESPONSES = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
