"""What a request body may be, checked before any route sees it: bounded size, time, depth and text.

`RequestLimits` is ASGI middleware in front of the routes. For every request it
  - answers 413 at once when Content-Length is over `max_bytes`, without reading a byte of the body,
    and 413 as soon as a body without one (chunked) grows past it: a 50 MB body is never held whole;
  - answers 408 when the body takes longer than `body_timeout` seconds to arrive (a slow client
    would otherwise hold a connection and a task forever);
  - answers 400 when the body is not UTF-8, nests arrays and objects deeper than `MAX_JSON_DEPTH`
    (Python's parser and everything after it recurse: 100,000 `[` is a RecursionError waiting to
    happen), or holds a lone UTF-16 surrogate escape ("\\ud800": valid JSON, but not text, and the
    tokenizer cannot encode it).
Then it hands the body on, unchanged, to the app. Every check runs at C speed (bytes.decode,
bytes.translate, numpy), so a body at the size limit costs milliseconds. The slow sending of the
headers themselves is bounded one level down, in the HTTP protocol (process.py).

Errors are OpenAI's error body, like every other error of the server. The rest of a body refused
unread is dropped as it arrives, for a bounded time (process.py), so the client reads the answer.
"""

import asyncio
import json

import numpy as np

from qwen3_scratch.text.limits import MAX_PROMPT_BYTES

# A prompt at its limit (text/limits.py), twice over for JSON escapes and the rest of the body.
MAX_BODY_BYTES = 2 * MAX_PROMPT_BYTES
# OpenAI bodies nest about 6 deep (a tool's JSON schema inside a tool inside a list); 64 leaves room.
MAX_JSON_DEPTH = 64
BODY_TIMEOUT = 30.0  # seconds for the whole body to arrive

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = np.frombuffer(b"[{", dtype=np.uint8)


def json_depth(text: bytes) -> int:
    """How deep arrays and objects nest in a JSON text, without parsing it. Strings are cut out first
    (a bracket inside a string is text), then only the brackets are kept and counted: +1 per opening
    one, -1 per closing one; the deepest point of the running sum is the depth."""
    brackets = _cut_strings(text).translate(None, _NOT_BRACKETS)
    marks = np.frombuffer(brackets, dtype=np.uint8)
    if marks.size == 0:
        return 0
    steps = np.where(np.isin(marks, _OPENING), 1, -1)
    return int(np.cumsum(steps).max())


def _cut_strings(text: bytes) -> bytes:
    """text with every JSON string removed: split on the quotes that are not escaped (a quote
    preceded by an odd run of backslashes is inside a string) and keep the pieces between strings."""
    if b"\\" in text:  # hide escaped backslashes and quotes first, so every quote left is a real one
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(text.split(b'"')[::2])


def has_lone_surrogate(text: str) -> bool:
    r"""True if JSON text holds a \uD800-\uDFFF escape that is not half of a valid pair."""
    if "\\ud" not in text.lower():  # the common case: no surrogate escape at all
        return False
    try:
        json.dumps(json.loads(text), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):  # not JSON: the route's parser will say so
        return False
    return False


class BodyError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


class RequestLimits:
    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT,
                 max_depth: int = MAX_JSON_DEPTH):  # fmt: skip
        self.app, self.max_bytes, self.body_timeout, self.max_depth = app, max_bytes, body_timeout, max_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await self.read_body(scope, receive)
            if body:
                self.check_text(body)
        except BodyError as error:
            return await reply(send, error)
        replayed = False

        async def replay():  # the body once, then what the client does next (a disconnect, say)
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def read_body(self, scope, receive) -> bytes:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise self.too_large()
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0))
            except asyncio.TimeoutError:
                raise BodyError(408, f"the request body took longer than {self.body_timeout:g} s to arrive",
                                "body_timeout") from None  # fmt: skip
            if message["type"] == "http.disconnect":
                raise BodyError(400, "the client went away before its body arrived", "disconnected")
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise self.too_large()
            if not message.get("more_body", False):
                return b"".join(chunks)

    def too_large(self) -> BodyError:
        return BodyError(413, f"the request body is over the limit of {self.max_bytes:,} bytes", "body_too_large")

    def check_text(self, body: bytes) -> None:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BodyError(400, f"the request body is not UTF-8 (byte {error.start}); send JSON in UTF-8",
                            "invalid_utf8") from None  # fmt: skip
        depth = json_depth(body)
        if depth > self.max_depth:
            raise BodyError(400, f"the request body nests {depth} levels deep; the limit is {self.max_depth}",
                            "too_deep")  # fmt: skip
        if has_lone_surrogate(text):
            raise BodyError(400, "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): "
                            "not text; send valid Unicode", "invalid_unicode")  # fmt: skip


async def reply(send, error: BodyError) -> None:
    body = json.dumps({"error": {"message": str(error), "type": "invalid_request_error", "code": error.code,
                                 "param": None}}).encode()  # fmt: skip
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
