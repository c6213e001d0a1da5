"""A real server for tests: our FastAPI app under uvicorn on 127.0.0.1, on its own thread, over an LLM."""

import socket
import threading
import time
from contextlib import contextmanager

import torch
import uvicorn

from qwen3_scratch.server.app import build_app
from qwen3_scratch.server.async_engine import AsyncEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def uvicorn_thread(app, **config):
    """Run `app` under uvicorn on a free port of 127.0.0.1 on a thread; yield its base URL, stop it after.
    config: more uvicorn.Config arguments (e.g. the server command's `http` protocol)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the server thread died while starting"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@contextmanager
def serving(llm, model_name: str, api_key: str | None = None, embedder=None):
    """Yield the server's base URL ("http://127.0.0.1:PORT") while it runs; stops it after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds waits on a shared 2-core machine
    engine = AsyncEngine(llm.engine).start() if llm is not None else None
    if llm is not None:
        app = build_app(engine, llm.tokenizer, model_name, llm.get_default_sampling_params(), api_key=api_key)
    else:
        app = build_app(None, embedder.tokenizer, model_name, None, api_key=api_key, embedder=embedder)
    try:
        with uvicorn_thread(app) as url:
            yield url
    finally:
        if engine is not None:
            engine.stop()
        torch.set_num_threads(threads)
