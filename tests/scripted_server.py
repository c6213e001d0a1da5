"""A real server on 127.0.0.1 whose model says what the test scripts, for the chat page's tests.

The engine, scheduler, block manager, parser and routes are the real ones; only the last step of the
model runner is bent: each new request takes the next script from a queue (token ids) and its output
tokens are forced to it, so a test knows the reply (reasoning, a tool call, markup) to the token. A
request with no script left gets the random model's own tokens. `delay` slows every step, so a
person (or a browser test) can watch an answer stream, see it in the engine view, and stop it.
"""

import re
import time
from collections import deque
from contextlib import contextmanager

import httpx
import torch
from live_server import wait_until
from openai_server import uvicorn_thread

from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.server.app import build_app
from qwen3_scratch.server.async_engine import AsyncEngine

API_KEY = "page-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-qwen3"
NUM_BLOCKS = 96
BLOCK_SIZE = 16
# a system prompt over five blocks long: two requests that share it share its full blocks
SYSTEM = ("You are a careful assistant. Answer in one short sentence, check every number twice, and say so "
          "when you do not know. The cache keeps the keys and values of every token before this one.")  # fmt: skip


class ScriptedRunner:
    """The engine's ModelRunner, forcing each scripted request's output tokens (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.queue: deque[list[int] | None] = deque()  # the scripts of the next requests, in arrival order
        self.scripts: dict[str, list[int] | None] = {}  # request id -> its script
        self.prompts: list[list[int]] = []  # every request's prompt ids, in the order the engine first ran them
        self.delay = 0.0  # seconds of sleep per step

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, batch):
        if self.delay:
            time.sleep(self.delay)
        logits = self.runner.run(batch)  # {id(seq): (V,)}
        for chunk in batch.decodes + batch.prefills:
            seq = chunk.seq
            if seq.request_id not in self.scripts:
                self.prompts.append(seq.token_ids[: seq.num_prompt_tokens])
                self.scripts[seq.request_id] = self.queue.popleft() if self.queue else None
            ids, row = self.scripts[seq.request_id], logits.get(id(seq))
            at = seq.num_tokens - seq.num_prompt_tokens  # the output token this row samples
            if ids is not None and row is not None and at < len(ids):
                row.fill_(float("-inf"))
                row[ids[at]] = 0.0
        return logits

    def reset(self) -> None:
        self.queue.clear()
        self.prompts.clear()
        self.delay = 0.0


class Served:
    """The running server: its URL, the LLM under it and the scripting runner."""

    def __init__(self, llm: LLM, engine: AsyncEngine, url: str):
        self.llm, self.engine, self.url = llm, engine, url
        self.runner: ScriptedRunner = llm.engine.runner

    def script(self, text: str) -> None:
        """Queue the next request's reply: text, then <|im_end|>."""
        tokenizer = self.llm.tokenizer
        self.runner.queue.append(tokenizer.encode(text) + self.llm.eos_ids[:1])

    def metric(self, name: str) -> float:
        """One number from GET /metrics (Prometheus text), as a scraper reads it."""
        text = httpx.get(f"{self.url}/metrics").text
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert found, f"/metrics has no {name}"
        return float(found.group(1))

    def idle(self) -> bool:
        blocks = self.llm.engine.blocks
        return blocks.num_free == blocks.num_blocks and not self.llm.engine.has_unfinished()

    def wait_idle(self) -> bool:
        return wait_until(self.idle)

    def prompt_text(self, index: int) -> str:
        return self.llm.tokenizer.decode(self.runner.prompts[index])


@contextmanager
def scripted_server(checkpoint, api_key: str | None = API_KEY):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds waits on a shared 2-core machine
    llm = LLM(str(checkpoint), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    llm.engine.runner = ScriptedRunner(llm.engine.runner)
    # the pool's in-place kernel built now, not at the first decode step of a test: in a process that had not
    # built it yet, that step took seconds, and an /engine/state polled meanwhile timed out (httpx's 5 s)
    _ = llm.engine.cache.in_place
    engine = AsyncEngine(llm.engine).start()
    app = build_app(engine, llm.tokenizer, MODEL, llm.get_default_sampling_params(), api_key=api_key)
    try:
        with uvicorn_thread(app) as url:
            yield Served(llm, engine, url)
    finally:
        engine.stop()
        torch.set_num_threads(threads)


def reset_around(server):
    """A test fixture's body: the server's scripted runner reset before and after the test, and the engine
    left with no request in it."""
    server.runner.reset()
    yield server
    server.runner.reset()
    assert server.wait_idle(), "a request was left in the engine"
