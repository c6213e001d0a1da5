"""The HTTP server: OpenAI's API on FastAPI, over the engine thread (async_engine.py).

Routes only translate: JSON -> token ids and SamplingParams -> `AsyncEngine.generate` -> step outputs
-> JSON (or server-sent events). Chat replies go through chat_parser, the same parser `LLM.chat`
uses, so reasoning and tool calls come out alike on both paths.

Every bad request gets OpenAI's error body `{"error": {"message", "type", "code"}}`: 400 for values
the engine refuses (and malformed JSON), 404 for an unknown model or route, 422 for a body of the
wrong shape, 401 for a missing or wrong API key, 413/408/400 for a body too big, too slow or too deep
(limits.py, before any route). A fault of the server's is 500 for the one request it hit, 503 when the
engine is dead or shutting down (/health then says so too), 504 past --request-timeout; nothing
reaches the client as a traceback, and the log holds it under the id the error message names. After
a stream has begun, the same error body comes as its last event, before `data: [DONE]`.

The API key guards /v1 only: /health, /metrics and /openapi.json stay open, as vLLM's do, for the
load balancers and Prometheus scrapers that carry no key (they hold no prompt or output text).
"""

import json
import logging
import secrets
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from qwen3_scratch.errors import GenerationError, Qwen3Error
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.chat_parser import StreamParser, prompt_opens_thinking
from qwen3_scratch.text.limits import MAX_BYTES_PER_TOKEN, check_fits
from qwen3_scratch.text.stop import AnswerStop
from qwen3_scratch.text.tokenizer import Tokenizer

from . import protocol as api
from . import schema
from .async_engine import AsyncEngine, ServingFault
from .limits import BODY_TIMEOUT, MAX_BODY_BYTES, RequestLimits

log = logging.getLogger("qwen3_scratch.server")


class ServerError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str):
        self.status, self.message, self.type, self.code = status, message, type_, code


@dataclass
class Serving:
    """What the routes need, kept on app.state: the engine thread and how to talk to it."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    defaults: SamplingParams  # the checkpoint's sampling defaults, for fields a request leaves out

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ServerError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                              "invalid_request_error", "model_not_found")  # fmt: skip

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt given as text -> its ids; one that cannot fit is refused before it is tokenized
        whole, by the CLI's rules (text/limits.py)."""
        check_fits(text, "prompt", self.tokenizer.encode, self.engine.engine.context)
        return self.tokenizer.encode(text)

    def check_chat_size(self, messages: list[dict]) -> None:
        """Refuse a chat far over the context before its template is rendered and tokenized whole."""
        limit = self.engine.engine.context * MAX_BYTES_PER_TOKEN
        size = sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in messages)
        if size > limit:
            raise GenerationError(f"the messages hold {size:,} characters, more than the model's context of "
                                  f"{self.engine.engine.context} tokens can hold at {MAX_BYTES_PER_TOKEN} per token")  # fmt: skip


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, defaults: SamplingParams,
              api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout: float = BODY_TIMEOUT) -> FastAPI:  # fmt: skip
    app = FastAPI(title="qwen3-scratch", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.serving = Serving(engine, tokenizer, model_name, defaults)
    add_error_handlers(app)
    app.add_middleware(RequestLimits, max_bytes=max_body_bytes, body_timeout=body_timeout)
    if api_key is not None:  # added last, so it runs first: no body is read for a client without the key
        app.middleware("http")(require_api_key(api_key))
    app.include_router(router)
    return app


def require_api_key(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path.startswith("/v1") and not secrets.compare_digest(given, expected):
            body = api.error_body("missing or wrong API key: send Authorization: Bearer <key>",
                                  "authentication_error", "invalid_api_key")  # fmt: skip
            return JSONResponse(body, status_code=401)
        return await call_next(request)

    return check


router = APIRouter()


@router.get("/health", responses=schema.HEALTH_RESPONSES)
async def health(request: Request):
    """200 while the engine runs; 503 once it died or the server is shutting down, so a load balancer
    stops sending requests here (and a supervisor, seeing the process exit, restarts it)."""
    engine: AsyncEngine = request.app.state.serving.engine
    if not engine.alive:
        return JSONResponse({"status": "dead"}, status_code=503)
    if engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", responses=schema.METRICS_RESPONSES)
async def metrics(request: Request):
    engine = request.app.state.serving.engine
    return Response(engine.metrics.text(engine.engine), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", responses=schema.MODELS_RESPONSES)
async def models(request: Request):
    s: Serving = request.app.state.serving
    card = {"id": s.model_name, "object": "model", "created": 0, "owned_by": "qwen3-scratch",
            "max_model_len": s.engine.engine.context}  # fmt: skip
    return {"object": "list", "data": [card]}


@router.post("/v1/completions", responses=schema.COMPLETION_RESPONSES)
async def completions(body: api.CompletionRequest, request: Request):
    s: Serving = request.app.state.serving
    s.check_model(body.model)
    prompt_ids = s.prompt_ids(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    params = body.params(s.defaults, body.max_tokens if body.max_tokens is not None else 16)  # OpenAI's default
    s.engine.check(prompt_ids, params)
    request_id = api.new_id("cmpl")
    steps = s.engine.generate(prompt_ids, params, request_id)
    if body.stream:
        return sse(stream_completion(steps, request_id, s.model_name, len(prompt_ids), body.include_usage))
    text, out = "", None
    async for out in steps:
        text += out.new_text
    used = api.usage(len(prompt_ids), len(out.seq.output_ids), out.seq.num_cached_prompt)
    return api.completion_body(request_id, s.model_name, text, out.finish_reason, used)


@router.post("/v1/chat/completions", responses=schema.CHAT_RESPONSES)
async def chat_completions(body: api.ChatCompletionRequest, request: Request):
    s: Serving = request.app.state.serving
    s.check_model(body.model)
    tools = body.template_tools()
    messages = body.chat_messages()
    s.check_chat_size(messages)
    prompt_ids = s.tokenizer.chat_ids(messages, enable_thinking=body.enable_thinking, tools=tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.params(s.defaults, max_tokens)  # None: up to the context, as vLLM does for chat
    s.engine.check(prompt_ids, params)
    parser = StreamParser(s.tokenizer, in_reasoning=prompt_opens_thinking(prompt_ids, s.tokenizer))
    request_id = api.new_id("chatcmpl")
    steps = s.engine.generate(prompt_ids, params, request_id)
    if body.stream:
        events = stream_chat(steps, parser, AnswerStop(params.stop), request_id, s.model_name, len(prompt_ids),
                             body.include_usage)  # fmt: skip
        return sse(events)
    out = None
    async for out in steps:
        for token in out.new_token_ids:
            parser.push(token)
    parser.finish()
    parsed = parser.message()
    parsed["content"] = AnswerStop.cut(parsed["content"], params.stop)  # the answer ends before a stop string
    used = api.usage(len(prompt_ids), len(out.seq.output_ids), out.seq.num_cached_prompt, parser.reasoning_tokens)
    reason = api.chat_finish_reason(out.finish_reason, parsed.get("tool_calls"))
    return api.chat_response(request_id, s.model_name, api.assistant_message(parsed), reason, used)


def sse(events) -> StreamingResponse:
    return StreamingResponse(ending_in_errors(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


async def ending_in_errors(events):
    """The events; a fault after the stream began (the status is sent) comes as a last error event."""
    try:
        async for item in events:
            yield item
    except ServingFault as error:
        yield event(api.error_body(str(error), error.type, error.code))
        yield "data: [DONE]\n\n"
    except Qwen3Error as error:
        yield event(api.error_body(str(error), "invalid_request_error", "invalid_value"))
        yield "data: [DONE]\n\n"
    except Exception as error:  # a bug: logged under an id, as the `unexpected` handler does
        error_id = api.new_id("error")
        log.error("%s: a stream failed", error_id, exc_info=error)
        message = f"internal error ({type(error).__name__}); the server log has it under {error_id}"
        yield event(api.error_body(message, "internal_server_error", 500))
        yield "data: [DONE]\n\n"


def event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream_completion(steps, request_id, model, prompt_tokens, include_usage):
    async for out in steps:  # leaving this loop early (client gone) closes `steps`, which aborts the request
        if out.new_text or out.finished:
            yield event(api.completion_body(request_id, model, out.new_text, out.finish_reason, chunk=True))
    if include_usage:
        used = api.usage(prompt_tokens, len(out.seq.output_ids), out.seq.num_cached_prompt)
        yield event({**api.completion_body(request_id, model, "", None, chunk=True), "choices": [], "usage": used})
    yield "data: [DONE]\n\n"


async def stream_chat(steps, parser: StreamParser, shown: AnswerStop, request_id, model, prompt_tokens, include_usage):
    yield event(api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}))
    calls = 0
    async for out in steps:
        deltas = [d for token in out.new_token_ids for d in parser.push(token)]
        if out.finished:
            deltas += parser.finish()
        for delta in shown.pieces(deltas, finished=out.finished):  # the answer held back while a stop string may form
            yield event(api.chat_chunk(request_id, model, api.delta_body(delta, calls)))
            calls += delta.kind == "tool_call"
    reason = api.chat_finish_reason(out.finish_reason, calls)
    yield event(api.chat_chunk(request_id, model, {}, reason))
    if include_usage:
        used = api.usage(prompt_tokens, len(out.seq.output_ids), out.seq.num_cached_prompt, parser.reasoning_tokens)
        yield event(api.chat_chunk(request_id, model, None, usage_body=used))
    yield "data: [DONE]\n\n"


def add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, type_: str, code, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(api.error_body(message, type_, code), status_code=status, headers=headers)

    @app.exception_handler(ServerError)
    async def server_error(request, error: ServerError):
        return reply(error.status, error.message, error.type, error.code)

    @app.exception_handler(Qwen3Error)
    async def engine_refused(request, error: Qwen3Error):
        return reply(400, str(error), "invalid_request_error", "invalid_value")

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, error: RequestValidationError):
        problems = error.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return reply(400, "the request body is not valid JSON", "invalid_request_error", "invalid_json")
        where = "; ".join(f"{'.'.join(str(x) for x in p['loc'] if x != 'body')}: {p['msg']}" for p in problems[:5])
        return reply(422, f"invalid request body: {where}", "invalid_request_error", "invalid_body")

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        # its headers too: a 405 says which methods the route takes (Allow)
        return reply(error.status_code, str(error.detail), "invalid_request_error", error.status_code, error.headers)

    @app.exception_handler(ServingFault)
    async def serving_fault(request, error: ServingFault):
        return reply(error.status, str(error), error.type, error.code)

    @app.exception_handler(Exception)
    async def unexpected(request, error: Exception):  # a bug: say so without leaking a traceback, log it
        error_id = api.new_id("error")
        log.error("%s: %s %s failed", error_id, request.method, request.url.path, exc_info=error)
        return reply(500, f"internal error ({type(error).__name__}); the server log has it under {error_id}",
                     "internal_server_error", 500)  # fmt: skip
