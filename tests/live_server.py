"""A real uvicorn server on 127.0.0.1 on a thread of the test process, for the server's hostile-input tests.

It runs the protocol the `qwen3-serve` command runs (server/process.py's header clock), over an engine
whose runner can be told to fail chosen requests: the test hook for "a fault inside the engine".
"""

import threading
import time
from contextlib import contextmanager

from openai_server import uvicorn_thread

from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.server.app import build_app
from qwen3_scratch.server.async_engine import AsyncEngine
from qwen3_scratch.server.process import header_timeout_protocol
from qwen3_scratch.server.watchdog import DEFAULT_STEP_TIMEOUT

API_KEY = "test-key"
MODEL = "tiny-qwen3"
POISON = [7, 7, 7]  # a prompt starting with these ids makes FaultyRunner raise for that request alone
HANG = [8, 8, 8]  # and these make its forward block until the test releases it: a step that hangs


class FaultyRunner:
    """The engine's ModelRunner, raising for every forward that includes a poisoned request, and blocking
    (`hung` set, until `release` is) in every forward that includes a hanging one."""

    def __init__(self, runner):
        self.runner = runner
        self.hung, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, batch):
        for chunk in batch.decodes + batch.prefills:
            if chunk.seq.token_ids[: len(POISON)] == POISON:
                raise RuntimeError(f"injected fault for {chunk.seq.request_id}")
            if chunk.seq.token_ids[: len(HANG)] == HANG:
                self.hung.set()
                self.release.wait(timeout=120)
        return self.runner.run(batch)


@contextmanager
def live_server(checkpoint, num_blocks=64, block_size=16, read_timeout=30.0, max_body_bytes=2**20,
                request_timeout=None, step_timeout=DEFAULT_STEP_TIMEOUT):  # fmt: skip
    """Yields (llm, engine, url): a served tiny model with an API key, its runner a FaultyRunner."""
    llm = LLM(str(checkpoint), num_blocks=num_blocks, block_size=block_size)
    llm.engine.runner = FaultyRunner(llm.engine.runner)
    engine = AsyncEngine(llm.engine, request_timeout=request_timeout, step_timeout=step_timeout).start()
    app = build_app(engine, llm.tokenizer, MODEL, llm.get_default_sampling_params(), api_key=API_KEY,
                    max_body_bytes=max_body_bytes, body_timeout=read_timeout)  # fmt: skip
    try:
        with uvicorn_thread(app, http=header_timeout_protocol(read_timeout)) as url:
            yield llm, engine, url
    finally:
        engine.stop()


def all_blocks_free(llm) -> bool:
    blocks = llm.engine.blocks
    return blocks.num_free == blocks.num_blocks and not llm.engine.has_unfinished()


def nothing_held(llm, engine) -> bool:
    """No request left anywhere: every block in the pool, no sequence, text, stream or timing entry."""
    return all_blocks_free(llm) and not (llm.engine.sequences or llm.engine.texts or engine.streams or engine.timing)


def wait_until(condition, seconds=30.0) -> bool:
    """Poll condition() until it holds: a bound for a broken server, not a speed check."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()
