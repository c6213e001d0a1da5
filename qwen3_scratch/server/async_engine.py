"""The engine on its own thread, fed by asyncio code (the HTTP server) without ever blocking it.

The engine is single-threaded: only the engine thread touches it (the one exception: `check`, which
only reads the config and the pool size). HTTP handlers talk to it through two channels:
  - an inbox (`queue.Queue`) of commands: add a request, abort one;
  - one `asyncio.Queue` per request, filled from the engine thread with `call_soon_threadsafe`.
So a slow client never slows a step, and a step never blocks the event loop. When the engine has
no work the thread sleeps on the inbox; when it has, it drains the inbox between steps.
"""

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator

from qwen3_scratch.engine.engine import LLMEngine, StepOutput
from qwen3_scratch.errors import Qwen3Error
from qwen3_scratch.sampling.params import SamplingParams

from .metrics import ServingMetrics


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServingMetrics | None = None):
        self.engine, self.metrics = engine, metrics or ServingMetrics()
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.timing: dict[str, list] = {}  # request id -> [arrival, first token time] (engine thread only)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="qwen3-engine", daemon=True)

    def start(self) -> "AsyncEngine":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)  # wake the thread if it sleeps on the inbox
        self.thread.join()

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise GenerationError now, in the caller's thread, for a request that can never run."""
        self.engine.check_prompt(prompt_ids, params)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Submit a request and yield its step outputs (of all its n choices, told apart by `index`) until
        every choice has finished. Leaving early aborts it."""
        request_id = f"req-{next(self._ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), outputs)
        self.inbox.put(("add", request_id, list(prompt_ids), params, time.monotonic()))
        finished, remaining = False, params.n  # each of the n choices finishes on its own
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    raise out
                remaining -= out.finished
                finished = remaining == 0
                yield out
        finally:  # also on cancellation: a client that went away frees its sequence
            self.streams.pop(request_id, None)
            if not finished:
                self.inbox.put(("abort", request_id))

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(wait=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self._step()

    def _drain(self, wait: bool) -> None:
        try:
            command = self.inbox.get(timeout=0.5) if wait else self.inbox.get_nowait()
            while True:
                self._apply(command)
                command = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, command) -> None:
        if command is None:
            return
        if command[0] == "abort":
            self.engine.abort(command[1])
            self.timing.pop(command[1], None)
            return
        _, request_id, prompt_ids, params, arrival = command
        if request_id not in self.streams:  # its client left before the engine saw it
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except Qwen3Error as error:
            self._deliver(request_id, error)
            return
        self.timing[request_id] = [arrival, None]
        self.metrics.prompt_tokens.inc(len(prompt_ids))

    def _step(self) -> None:
        preempted_before = self.engine.num_preemptions
        try:
            outputs = self.engine.step()
        except Exception as error:  # a bug: fail the requests in flight (HTTP 500) rather than hang them
            for request_id in list(self.engine.sequences):
                self.engine.abort(request_id)
                self._deliver(request_id, error)
            return
        now = time.monotonic()
        for out in outputs:
            timing = self.timing.get(out.request_id)
            if timing is not None and timing[1] is None:
                timing[1] = now
            if out.finished and timing is not None:
                self.timing.pop(out.request_id)
                self.metrics.finished(timing[0], timing[1], now, len(out.seq.output_ids))
            self._deliver(out.request_id, out)
        self.metrics.step(self.engine, len(outputs), self.engine.num_preemptions - preempted_before)

    def _deliver(self, request_id: str, item) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass
