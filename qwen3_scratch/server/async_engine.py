"""The engine on its own thread, fed by asyncio code (the HTTP server) without ever blocking it.

The engine is single-threaded: only the engine thread touches it (the one exception: `check`, which
only reads the config and the pool size). HTTP handlers talk to it through two channels:
  - an inbox (`queue.Queue`) of commands: add a request, abort one, take a snapshot (`state`);
  - one `asyncio.Queue` per request, filled from the engine thread with `call_soon_threadsafe`.
So a slow client never slows a step, and a step never blocks the event loop. When the engine has
no work the thread sleeps on the inbox; when it has, it drains the inbox between steps.

Faults: a request the engine fails alone (engine/faults.py) raises RequestFailed in its handler only
(HTTP 500, its id in the log). Anything that escapes a step kills the engine, and so does a step that
runs past `step_timeout` seconds without returning (watchdog.py): every request in flight, waiting
ones included, raises EngineDied at once (HTTP 500, as vLLM answers its EngineDeadError; a stream
ends with that error event), every new one EngineUnavailable (HTTP 503), `alive` turns false (so
does /health) and `on_fatal` runs (the server process then exits non-zero, for a supervisor to
restart it). While the server drains for shutdown, new requests get EngineUnavailable too. A request
that runs past `request_timeout` seconds is aborted and raises RequestTimedOut (HTTP 504).
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from qwen3_scratch.engine.engine import LLMEngine, StepOutput
from qwen3_scratch.engine.snapshot import snapshot
from qwen3_scratch.errors import Qwen3Error
from qwen3_scratch.sampling.params import SamplingParams

from .metrics import ServingMetrics
from .watchdog import DEFAULT_STEP_TIMEOUT, StepWatchdog

log = logging.getLogger("qwen3_scratch.server")


class ServingFault(Exception):
    """A request the server could not serve, for a reason of the server's, not the request's."""

    status, type, code = 500, "internal_server_error", "internal_error"


class RequestFailed(ServingFault):
    def __init__(self, request_id: str, error: BaseException):
        super().__init__(f"the engine failed this request ({type(error).__name__}); the other requests go on. "
                         f"The server log has the details under {request_id}")  # fmt: skip


class EngineUnavailable(ServingFault):
    status, type, code = 503, "service_unavailable", "engine_unavailable"


class EngineDied(ServingFault):
    """The engine died with this request in it: nothing more will come for it on this server."""

    code = "engine_dead"


class RequestTimedOut(ServingFault):
    status, type, code = 504, "timeout", "request_timeout"


def start_where_loaded(load, **options) -> tuple:
    """(load()'s LLM, its AsyncEngine running, or None for an embedding model): load() builds the LLM on a new
    thread, which then runs the engine's steps, so the model is loaded, warmed up and stepped on one thread.
    torch's OpenMP keeps a thread pool per thread that ran parallel work, and steps run on a thread other than
    the one that loaded the model took 1.2-1.9x as long (docs/performance.md, "Found ... the engine is slower on a
    thread other than the one that loaded the model"). What load() raises (a bad flag or file) is raised here,
    in the caller's thread; options go to AsyncEngine."""
    handoff: queue.Queue = queue.Queue()

    def engine_thread() -> None:
        try:
            llm = load()
            engine = None if llm.is_embedding_model else AsyncEngine(llm.engine, **options)
        except BaseException as error:  # noqa: BLE001 - handed to the caller, who reports it
            handoff.put(error)
            return
        handoff.put((llm, engine))
        if engine is not None:
            engine.run_here()

    threading.Thread(target=engine_thread, name="qwen3-engine", daemon=True).start()
    result = handoff.get()
    if isinstance(result, BaseException):
        raise result
    return result


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServingMetrics | None = None, request_timeout: float | None = None,
                 on_fatal=None, step_timeout: float | None = DEFAULT_STEP_TIMEOUT):  # fmt: skip
        self.engine, self.metrics = engine, metrics or ServingMetrics()
        self.request_timeout = request_timeout  # seconds from arrival to the last token, or None: no deadline
        self.on_fatal = on_fatal  # called (on the engine's or the watchdog's thread) with what killed the engine
        self.fatal: BaseException | None = None
        self._dying = threading.Lock()  # the engine dies once, whether its step raised or hung
        self.watchdog = StepWatchdog(step_timeout, self._die)  # step_timeout None: steps are not timed
        self.draining = False  # set at shutdown: requests in flight finish, new ones are refused
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.timing: dict[str, list] = {}  # request id -> [arrival, first token time] (engine thread only)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="qwen3-engine", daemon=True)

    def start(self) -> "AsyncEngine":
        self.thread.start()
        self.watchdog.start()
        return self

    def run_here(self) -> None:
        """The engine loop on the calling thread instead of a new one (start_where_loaded), until stop()."""
        self.thread = threading.current_thread()
        self.watchdog.start()
        self._run()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)  # wake the thread if it sleeps on the inbox
        self.watchdog.stop()
        # a thread stuck in a hung step never returns: it is a daemon, and ends with the process
        self.thread.join(timeout=None if self.fatal is None else 1.0)

    @property
    def alive(self) -> bool:
        return self.fatal is None and self.thread.is_alive()

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise now, in the caller's thread: GenerationError for a request that can never run,
        EngineUnavailable if no request can run."""
        self._check_available()
        self.engine.check_prompt(prompt_ids, params)

    def _check_available(self) -> None:
        if self.fatal is not None or not self.thread.is_alive():
            raise EngineUnavailable(f"the engine is dead ({self.fatal!r}); the server is restarting")
        if self.draining:
            raise EngineUnavailable("the server is shutting down; retry on another replica or after its restart")

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:  # fmt: skip
        """Submit a request and yield its step outputs (of all its n choices, told apart by `index`) until
        every choice has finished. Leaving early aborts it."""
        request_id = request_id or f"req-{next(self._ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), outputs)
        arrival = time.monotonic()
        deadline = arrival + self.request_timeout if self.request_timeout is not None else None
        finished, remaining = False, params.n  # each of the n choices finishes on its own
        try:
            self._check_available()  # after registering: a death from now on reaches this stream
            self.inbox.put(("add", request_id, list(prompt_ids), params, arrival))
            while not finished:
                out = await self._next(outputs, deadline)
                if isinstance(out, BaseException):
                    raise out
                remaining -= out.finished
                finished = remaining == 0
                yield out
        finally:  # also on cancellation: a client that went away frees its sequence
            self.streams.pop(request_id, None)
            if not finished:
                self.inbox.put(("abort", request_id))

    async def state(self, timeout: float = 30.0) -> dict:
        """The engine now (engine/snapshot.py) and its output rate, taken on the engine thread between two
        steps, where nothing moves under it. Waits for the step in progress, at most `timeout` seconds."""
        if self.fatal is not None or not self.thread.is_alive():
            raise EngineUnavailable(f"the engine is dead ({self.fatal!r}); the server is restarting")
        answer = asyncio.get_running_loop().create_future()
        self.inbox.put(("state", answer))
        try:
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            raise EngineUnavailable(f"the engine did not answer within {timeout:g} s: a step that long, "
                                    "or the engine is stuck") from None  # fmt: skip

    async def _next(self, outputs: asyncio.Queue, deadline: float | None):
        if deadline is None:
            return await outputs.get()
        try:
            return await asyncio.wait_for(outputs.get(), max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            raise RequestTimedOut(f"the request ran past the server's deadline of {self.request_timeout:g} s "
                                  "(--request-timeout); ask for fewer tokens") from None  # fmt: skip

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.fatal is None:
                self._drain(wait=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as error:  # engine/faults.py: what escapes a step is the engine's, not a request's
            self._die(error)

    def _die(self, error: BaseException) -> None:
        """From the engine thread (a step raised) or the watchdog's (a step hung); only the first death counts."""
        with self._dying:
            if self.fatal is not None:
                return
            self.fatal = error  # from here on new requests are refused (_check_available)
        log.critical("the engine died; failing every request in flight", exc_info=error)
        message = f"the engine died while serving this request ({type(error).__name__}); the server is restarting"
        for request_id in list(self.streams):  # those in the engine and those still in the inbox
            self._deliver(request_id, EngineDied(message))
        if self.on_fatal is not None:
            self.on_fatal(error)

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
        if command[0] == "state":
            rate = self.metrics.rate(time.monotonic())
            self._answer(command[1], {**snapshot(self.engine), "tokens_per_second": rate})
            return
        _, request_id, prompt_ids, params, arrival = command
        if request_id not in self.streams:  # its client left before the engine saw it
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except Qwen3Error as error:
            self._deliver(request_id, error)
            return
        except Exception as error:  # add_request touches only this request's state: fail it alone
            log.error("request %s failed on arrival; the other requests go on", request_id, exc_info=error)
            self.engine.abort(request_id)
            self._deliver(request_id, RequestFailed(request_id, error))
            return
        self.timing[request_id] = [arrival, None]
        self.metrics.prompt_tokens.inc(len(prompt_ids))

    def _step(self) -> None:
        preempted_before = self.engine.num_preemptions
        with self.watchdog:  # timed: a step that never returns kills the engine from the watchdog's thread
            outputs = self.engine.step()  # raises only when the engine cannot go on (_run)
        if self.fatal is not None:  # it returned after all, too late: its requests were failed
            return
        now = time.monotonic()
        for out in outputs:
            if out.error is not None:  # failed alone; the engine logged it under its id
                self.timing.pop(out.request_id, None)
                self.metrics.failed.inc()
                self._deliver(out.request_id, RequestFailed(out.request_id, out.error))
                continue
            timing = self.timing.get(out.request_id)
            if timing is not None and timing[1] is None:
                timing[1] = now
            if out.finished and timing is not None:
                self.timing.pop(out.request_id)
                self.metrics.finished(timing[0], timing[1], now, len(out.seq.output_ids))
            self._deliver(out.request_id, out)
        new_tokens = sum(len(out.new_token_ids) for out in outputs)  # a speculative row emits several
        self.metrics.step(self.engine, new_tokens, self.engine.num_preemptions - preempted_before)

    def _answer(self, future: asyncio.Future, value) -> None:
        """Resolve a handler's future from this thread (unless its handler gave up waiting)."""

        def resolve():
            if not future.done():
                future.set_result(value)

        try:
            future.get_loop().call_soon_threadsafe(resolve)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _deliver(self, request_id: str, item) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        loop, outputs = stream
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass
