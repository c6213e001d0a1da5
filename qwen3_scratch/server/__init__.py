"""OpenAI's HTTP API over the engine: FastAPI routes, the engine's thread, Prometheus metrics.

async_engine.py (the engine on its own thread, fed by asyncio handlers; its faults as HTTP statuses),
watchdog.py (a step that hangs kills the engine),
protocol.py (OpenAI's request and response bodies), messages.py (the shapes of chat messages and tools),
fields.py (every OpenAI request field: implemented, accepted or refused), app.py (the routes: JSON ->
engine -> JSON or server-sent events), choices.py (a response's n choices, whole or streamed),
logprobs.py (OpenAI's two logprobs shapes), structured.py (response_format and tool_choice -> a
grammar), embeddings.py (/v1/embeddings), limits.py (body size, time, depth and text, before any
route), schema.py (the answers, described for /openapi.json), process.py (uvicorn with a header clock,
SIGTERM draining, the exit status), metrics.py, and page.py (the chat page at / and the engine view at
/engine: static/ holds its HTML, JavaScript and CSS; /engine/state is what the view polls). Needs the
`serve` extra (FastAPI, uvicorn, prometheus_client, llguidance).

May import: engine, text, sampling, the package root. Imported by: cli (qwen3-serve).
"""
