"""The HTTP server: OpenAI's API on FastAPI, over the engine thread (async_engine.py).

Routes only translate: JSON -> token ids and SamplingParams -> `AsyncEngine.generate` -> step outputs
-> JSON (or server-sent events). Chat replies go through chat_parser, the same parser `LLM.chat`
uses, so reasoning and tool calls come out alike on both paths.

Every bad request gets OpenAI's error body `{"error": {"message", "type", "code", "param"}}`: 400 for
values the engine refuses, for fields this server does not implement (fields.py: `param` names the field)
and for malformed JSON, 404 for an unknown model or route, 422 for a body of the wrong shape, 401 for a
missing or wrong API key, 413/408/400 for a body too big, too slow or too deep (limits.py, before any
route). A fault of the server's is 500 for the one request it hit, 503 when the engine is dead or
shutting down (/health then says so too), 504 past --request-timeout; nothing reaches the client as a
traceback, and the log holds it under the id the error message names. After a stream has begun, the
same error body comes as its last event, before `data: [DONE]`.

The API key guards /v1 and the engine view's /engine/state: /health, /metrics and /openapi.json stay
open, as vLLM's do, for the load balancers and Prometheus scrapers that carry no key (they hold no prompt
or output text), and so does the chat page itself (page.py), which asks the person for the key.

A request's n choices (and each prompt of a list on /v1/completions) are built by choices.py; logprobs
are formatted by logprobs.py; response_format and tool_choice become a grammar in structured.py.
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
from qwen3_scratch.text.limits import MAX_BYTES_PER_TOKEN, check_fits
from qwen3_scratch.text.tokenizer import Tokenizer

from . import protocol as api
from . import schema
from .async_engine import AsyncEngine, ServingFault
from .choices import ChatChoice, CompletionChoice, merge
from .embeddings import EMBEDDINGS
from .embeddings import router as embeddings_router
from .fields import CHAT, CHAT_VLLM, COMPLETIONS, RefusedField
from .limits import BODY_TIMEOUT, MAX_BODY_BYTES, RequestLimits
from .page import STATE_PATH
from .page import router as page_router
from .logprobs import vllm_prompt_logprobs
from .structured import after_reasoning, chat_structure, from_vllm_fields

log = logging.getLogger("qwen3_scratch.server")


class ServerError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str):
        self.status, self.message, self.type, self.code = status, message, type_, code


@dataclass
class Serving:
    """What the routes need, kept on app.state: the engine thread and how to talk to it."""

    engine: AsyncEngine | None  # None: an embedding checkpoint, served at /v1/embeddings only
    tokenizer: Tokenizer
    model_name: str
    defaults: SamplingParams | None  # the checkpoint's sampling defaults, for fields a request leaves out
    embedder: object | None = None  # engine/embedder.py's Embedder, for an embedding checkpoint

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ServerError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                              "invalid_request_error", "model_not_found")  # fmt: skip

    def check_generative(self) -> None:
        if self.engine is None:
            raise RefusedField("model", f"{self.model_name} is an embedding model: it serves /v1/embeddings only")

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


def build_app(engine: AsyncEngine | None, tokenizer: Tokenizer, model_name: str, defaults: SamplingParams | None,
              api_key: str | None = None, embedder=None, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout: float = BODY_TIMEOUT) -> FastAPI:  # fmt: skip
    """The app over a generative engine, or (engine None) over an embedding checkpoint's embedder."""
    app = FastAPI(title="qwen3-scratch", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.serving = Serving(engine, tokenizer, model_name, defaults, embedder)
    add_error_handlers(app)
    app.add_middleware(RequestLimits, max_bytes=max_body_bytes, body_timeout=body_timeout)
    if api_key is not None:  # added last, so it runs first: no body is read for a client without the key
        app.middleware("http")(require_api_key(api_key))
    app.include_router(router)
    app.include_router(embeddings_router)
    app.include_router(page_router)
    return app


def require_api_key(api_key: str):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        path = request.url.path
        guarded = path.startswith("/v1") or path == STATE_PATH
        if guarded and not secrets.compare_digest(given, expected):
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
    engine: AsyncEngine | None = request.app.state.serving.engine
    if engine is not None and not engine.alive:
        return JSONResponse({"status": "dead"}, status_code=503)
    if engine is not None and engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", responses=schema.METRICS_RESPONSES)
async def metrics(request: Request):
    engine = request.app.state.serving.engine
    if engine is None:  # an embedding server runs no engine: nothing to report yet
        return Response("", media_type=CONTENT_TYPE_LATEST)
    return Response(engine.metrics.text(engine.engine), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", responses=schema.MODELS_RESPONSES)
async def models(request: Request):
    s: Serving = request.app.state.serving
    card = {"id": s.model_name, "object": "model", "created": 0, "owned_by": "qwen3-scratch",
            "max_model_len": s.engine.engine.context if s.engine else s.embedder.context}  # fmt: skip
    return {"object": "list", "data": [card]}


@router.post("/v1/completions", responses=schema.COMPLETION_RESPONSES)
async def completions(body: api.CompletionRequest, request: Request):
    s: Serving = request.app.state.serving
    s.check_model(body.model)
    s.check_generative()
    body.check_fields("completions")
    prompts = [s.prompt_ids(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default
    echo_only = body.echo and max_tokens == 0  # OpenAI's way to score a prompt: echo it, generate nothing
    k = body.logprobs
    structured = from_vllm_fields(body)
    params = body.params(s.defaults, 1 if echo_only else max_tokens, logprobs=k,
                         prompt_logprobs=k if body.echo and k is not None else None,
                         structured=structured[1] if structured else None)  # fmt: skip
    for ids in prompts:
        s.engine.check(ids, params)
    choices = {(p, i): CompletionChoice(p * params.n + i, s.tokenizer, ids, body.echo, k is not None)
               for p, ids in enumerate(prompts) for i in range(params.n)}  # fmt: skip
    request_id = api.new_id("cmpl")
    steps = merge([s.engine.generate(ids, params, f"{request_id}-{p}") for p, ids in enumerate(prompts)])
    if body.stream:
        return sse(stream_completion(steps, choices, request_id, s.model_name, prompts, body.include_usage, echo_only))
    async for p, out in steps:
        choices[(p, out.index)].push(out, 0)
    used = completion_usage(prompts, choices, echo_only)
    bodies = [c.whole(keep_generated=not echo_only) for c in sorted(choices.values(), key=lambda c: c.index)]
    return api.completion_body(request_id, s.model_name, bodies, used)


def completion_usage(prompts, choices, echo_only: bool) -> dict:
    generated = 0 if echo_only else sum(len(c.out.seq.output_ids) for c in choices.values())
    cached = sum(choices[(p, 0)].out.seq.num_cached_prompt for p in range(len(prompts)))
    return api.usage(sum(len(ids) for ids in prompts), generated, cached)


@router.post("/v1/chat/completions", responses=schema.CHAT_RESPONSES)
async def chat_completions(body: api.ChatCompletionRequest, request: Request):
    s: Serving = request.app.state.serving
    s.check_model(body.model)
    s.check_generative()
    body.check_fields("chat")
    structured = chat_structure(body, s.tokenizer)
    messages = body.chat_messages()
    s.check_chat_size(messages)
    thinking = body.enable_thinking
    if structured is not None and thinking:
        structured = after_reasoning(structured, s.tokenizer)
        thinking = structured.reasoning_end_str is not None  # a tokenizer with no </think>: no reasoning first
    prompt_ids = s.tokenizer.chat_ids(messages, enable_thinking=thinking, tools=body.template_tools())
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # max_tokens None: up to the context, as vLLM does for chat
    params = body.params(s.defaults, max_tokens, logprobs=body.logprobs_k(), structured=structured)
    s.engine.check(prompt_ids, params)
    choices = [ChatChoice(i, s.tokenizer, prompt_ids, params, body.logprobs) for i in range(params.n)]
    request_id = api.new_id("chatcmpl")
    steps = s.engine.generate(prompt_ids, params, request_id)
    if body.stream:
        return sse(stream_chat(steps, choices, request_id, s.model_name, len(prompt_ids), body.include_usage,
                               s.tokenizer))  # fmt: skip
    async for out in steps:
        choices[out.index].push(out)
    response = api.chat_response(request_id, s.model_name, [c.whole() for c in choices],
                                 chat_usage(len(prompt_ids), choices))  # fmt: skip
    if params.prompt_logprobs is not None:  # vLLM's extension, beside OpenAI's fields
        response["prompt_logprobs"] = vllm_prompt_logprobs(s.tokenizer, choices[0].out.seq.sampling.prompt_logprobs)
    return response


def chat_usage(prompt_tokens: int, choices: list[ChatChoice]) -> dict:
    generated = sum(len(c.out.seq.output_ids) for c in choices)
    reasoning = sum(c.parser.reasoning_tokens for c in choices)
    return api.usage(prompt_tokens, generated, choices[0].out.seq.num_cached_prompt, reasoning)


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


async def stream_completion(steps, choices, request_id, model, prompts, include_usage, echo_only):
    def chunk(choice, seq, text, reason=None, logprobs=None):
        body = choice.chunk_body(seq, text, reason, logprobs)
        return event(api.completion_body(request_id, model, [body], chunk=True))

    echoed: dict[int, int] = {}  # choice index -> characters of echoed prompt text sent before its own text
    async for p, out in steps:  # leaving this loop early (client gone) closes `steps`, which aborts the request
        choice = choices[(p, out.index)]
        if choice.echo and choice.index not in echoed:
            text, logprobs = choice.prompt_part(out.seq)
            echoed[choice.index] = len(text)
            yield chunk(choice, out.seq, text, logprobs=logprobs)
        logprobs = choice.push(out, echoed.get(choice.index, 0) + len(choice.text))
        if echo_only:
            if out.finished:
                yield chunk(choice, out.seq, "", "length")
        elif out.new_text or out.finished or logprobs:
            yield chunk(choice, out.seq, out.new_text, out.finish_reason, logprobs)
    if include_usage:
        used = completion_usage(prompts, choices, echo_only)
        yield event({**api.completion_body(request_id, model, [], chunk=True), "usage": used})
    yield "data: [DONE]\n\n"


async def stream_chat(steps, choices: list[ChatChoice], request_id, model, prompt_tokens, include_usage, tokenizer):
    for choice in choices:
        yield event(api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}, index=choice.index))
    scores_due = True  # vLLM's prompt_logprobs, if asked: on the first chunk the engine's output makes
    async for out in steps:
        choice = choices[out.index]
        logprobs = choice.step_logprobs(out)
        bodies = [api.chat_chunk(request_id, model, delta, index=choice.index, logprobs=None if j else logprobs)
                  for j, delta in enumerate(choice.push(out))]  # fmt: skip
        if out.finished:
            bodies.append(api.chat_chunk(request_id, model, {}, choice.finish_reason, index=choice.index))
        if scores_due and bodies and out.seq.params.prompt_logprobs is not None:
            bodies[0]["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.seq.sampling.prompt_logprobs)
            scores_due = False
        for body in bodies:
            yield event(body)
    if include_usage:
        yield event(api.chat_chunk(request_id, model, None, usage_body=chat_usage(prompt_tokens, choices)))
    yield "data: [DONE]\n\n"


# the request fields an engine error may name, for its `param`
KNOWN_FIELDS = set(CHAT) | set(CHAT_VLLM) | set(COMPLETIONS) | set(EMBEDDINGS)


def add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, type_: str, code, param: str | None = None,
              headers: dict | None = None) -> JSONResponse:  # fmt: skip
        return JSONResponse(api.error_body(message, type_, code, param), status_code=status, headers=headers)

    @app.exception_handler(ServerError)
    async def server_error(request, error: ServerError):
        return reply(error.status, error.message, error.type, error.code)

    @app.exception_handler(RefusedField)
    async def refused_field(request, error: RefusedField):
        return reply(400, error.message, "invalid_request_error", "invalid_value", error.param)

    @app.exception_handler(Qwen3Error)
    async def engine_refused(request, error: Qwen3Error):
        first = str(error).split(" ", 1)[0]  # "logit_bias token ids must be ...": name the field
        param = first if first in KNOWN_FIELDS else None
        return reply(400, str(error), "invalid_request_error", "invalid_value", param)

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
        return reply(error.status_code, str(error.detail), "invalid_request_error", error.status_code,
                     headers=error.headers)  # fmt: skip

    @app.exception_handler(ServingFault)
    async def serving_fault(request, error: ServingFault):
        return reply(error.status, str(error), error.type, error.code)

    @app.exception_handler(Exception)
    async def unexpected(request, error: Exception):  # a bug: say so without leaking a traceback, log it
        error_id = api.new_id("error")
        log.error("%s: %s %s failed", error_id, request.method, request.url.path, exc_info=error)
        return reply(500, f"internal error ({type(error).__name__}); the server log has it under {error_id}",
                     "internal_server_error", 500)  # fmt: skip
