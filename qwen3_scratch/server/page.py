"""The server's own page: a chat at `GET /`, a live view of the engine at `GET /engine`, and the JSON it polls.

The page is three static files shipped in the package (static/: index.html, app.js, style.css), plain
HTML, JavaScript and CSS with no build step and nothing fetched from elsewhere, so it works offline
and a `pip install` carries it. It talks to the same /v1/chat/completions any client uses (streamed,
with the API key the person types in when the server answers 401); the engine view polls
`GET /engine/state`, a snapshot taken on the engine's thread between two steps (engine/snapshot.py)
plus the output rate. Both pages are one file: the script shows the engine alone at /engine.

The page holds no data, so it is served without a key; /engine/state lists requests (ids and lengths,
no text) and needs the key when the server has one, as /v1 does (app.py's require_api_key).
A Content-Security-Policy allows this server's own files only: no inline script runs, so even a
mistake that let model output in as HTML could not run it (the script inserts it as text regardless).
"""

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import protocol as api

STATIC = files("qwen3_scratch.server") / "static"
FILES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")  # fmt: skip
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
STATE_PATH = "/engine/state"

router = APIRouter()


def static(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=HEADERS)


@router.get("/", include_in_schema=False)
@router.get("/engine", include_in_schema=False)
async def page():
    return static("index.html", "text/html; charset=utf-8")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str):
    if name not in FILES:  # a fixed list: no path from the URL ever reaches the file system
        return JSONResponse(api.error_body(f"no file {name!r} here", "invalid_request_error", 404), status_code=404)
    return static(name, FILES[name])


@router.get(STATE_PATH, include_in_schema=False)
async def engine_state(request: Request):
    """The engine now: running and waiting requests, the KV pool block by block, rates and counters."""
    s = request.app.state.serving  # app.py's Serving
    s.check_generative()
    state = await s.engine.state()
    return JSONResponse({"model": s.model_name, **state}, headers={"Cache-Control": "no-store"})
