"""OpenAI's HTTP API over the engine: FastAPI routes, the engine's thread, Prometheus metrics.

async_engine.py (the engine on its own thread, fed by asyncio handlers), protocol.py (OpenAI's
request and response bodies), app.py (the routes: JSON -> engine -> JSON or server-sent events) and
metrics.py. Needs the `serve` extra (FastAPI, uvicorn, prometheus_client).

May import: engine, text, sampling, the package root. Imported by: cli (qwen3-serve).
"""
