"""A real server for tests: our FastAPI app under uvicorn on 127.0.0.1, on its own thread, over an LLM."""

import socket
import threading
import time
from contextlib import contextmanager

import torch
import uvicorn

from qwen3_scratch.server.app import build_app
from qwen3_scratch.server.async_engine import AsyncEngine


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server thread died while starting"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()
        if engine is not None:
            engine.stop()
        torch.set_num_threads(threads)
