"""A watchdog over the engine's steps: a step that does not return within its bound kills the engine.

A step that raises is caught on the engine thread (async_engine.py); a step that hangs - a deadlocked
collective between tensor-parallel ranks, a wedged device, a kernel spinning forever - returns nothing
and raises nothing, so without a clock every request in flight would wait forever and /health would
keep saying ok. The engine thread marks when each step begins and ends; this thread, on its own,
checks every `poll` seconds, and once a step has run past `timeout` it calls `on_hang` (once): the
engine is then dead exactly as if the step had raised (vLLM's engine-dead behaviour), and the process
exits for a supervisor to restart it. The hung thread itself cannot be stopped from Python; it is a
daemon thread and dies with the process.

The bound is generous by default (DEFAULT_STEP_TIMEOUT): one step is at most one prompt chunk of
--max-num-batched-tokens plus one decode token per running request; 512 tokens through an 8B model are
~8 TFLOP, ~20 s at the float32 peak of 2 AVX-512 cores, and 300 s leaves an order of magnitude more,
because a bound too tight kills a healthy server (docs/performance.md, issue 32).

A hang that holds the GIL (a C extension spinning without releasing it) stops this thread too, and
is not caught here.
"""

import sys
import threading
import time
import traceback
from collections.abc import Callable

DEFAULT_STEP_TIMEOUT = 300.0  # seconds


class StepHung(RuntimeError):
    """A step ran past the step timeout: the engine is stuck, not merely slow."""


class StepWatchdog:
    """`with watchdog: engine.step()` on the engine thread times that step; timeout None times nothing."""

    def __init__(self, timeout: float | None, on_hang: Callable[[StepHung], None]):
        self.timeout, self.on_hang = timeout, on_hang
        self.poll = min(timeout / 4, 1.0) if timeout is not None else None  # late by at most a quarter of the bound
        self.started: float | None = None  # when the step now running began; None between steps
        self.stepper: threading.Thread | None = None  # the thread running it (for its stack in the error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="qwen3-watchdog", daemon=True)

    def start(self) -> "StepWatchdog":
        if self.timeout is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> None:
        self.stepper = threading.current_thread()
        self.started = time.monotonic()

    def __exit__(self, *exc) -> None:
        self.started = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout:
                self.on_hang(StepHung(f"a step has run for over {self.timeout:g} s (--step-timeout) without "
                                      f"returning; the engine thread is stuck at:\n{self._where()}"))  # fmt: skip
                return

    def _where(self) -> str:
        frame = sys._current_frames().get(self.stepper.ident) if self.stepper is not None else None
        return "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(unknown)"
