"""The server as a process: uvicorn serving the app, the limits that live below it, and an exit status.

- Slow headers. A client must send a request's headers within `read_timeout` seconds of opening the
  connection (or of the previous response, on a kept-alive one), else the connection is closed.
  uvicorn bounds only the idle time between requests, and restarts that clock on every byte, so a
  client sending one header byte every few seconds would hold a connection forever. The same clock
  bounds the rest of a body the server answered without reading (a 413): uvicorn drops those bytes
  as they come, so that the client, still sending, then reads the answer rather than a reset
  connection. (The time and size of a body the app reads are bounded in limits.py.)
- SIGTERM drains the server: new requests get 503 and /health turns 503, requests in flight run to
  their end for up to `shutdown_grace` seconds, the rest are then aborted (their blocks freed), and
  the process exits 0. Ctrl-C does the same and exits 130, like the other commands.
- A dead engine (async_engine.py: a step raised, or hung past --step-timeout) stops the server at once,
  every request in flight already failed with 500, and the process exits 1, for a supervisor (systemd,
  Kubernetes) to restart it. A hung engine thread is a daemon: it does not hold the exit up.
"""

import logging
import signal
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .async_engine import AsyncEngine

EXIT_ENGINE_DIED = 1
log = logging.getLogger("qwen3_scratch.server")


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol, with a clock on each request's arrival."""

    class H11WithHeaderTimeout(H11Protocol):
        _clock = None
        _clock_cycle = None  # the request/response cycle when the clock started: the next one must begin

        def connection_made(self, transport):
            super().connection_made(transport)
            self._start_clock()

        def on_response_complete(self):
            super().on_response_complete()
            # The next request must arrive in time, and so must the rest of this one's body if the
            # answer came first (a 413): uvicorn reads and drops it, so the client sees the answer.
            self._start_clock()

        def data_received(self, data: bytes):
            super().data_received(data)
            if self.cycle is not self._clock_cycle:  # a new request's headers are in
                self._stop_clock()

        def connection_lost(self, exc):
            self._stop_clock()
            super().connection_lost(exc)

        def _start_clock(self):
            self._stop_clock()
            if not self.transport.is_closing():
                self._clock_cycle = self.cycle
                self._clock = self.loop.call_later(seconds, self._too_slow)

        def _stop_clock(self):
            if self._clock is not None:
                self._clock.cancel()
                self._clock = None

        def _too_slow(self):
            if self.cycle is self._clock_cycle and not self.transport.is_closing():
                log.warning("closing a connection whose next request took over %g s to arrive", seconds)
                self.transport.close()

    return H11WithHeaderTimeout


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which also tells the engine to refuse new requests once a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.draining = True
        super().handle_exit(sig, frame)


def serve_without_engine(app, host: str, port: int, read_timeout: float) -> int:
    """Serve an app with no engine thread (an embedding checkpoint) until a signal stops it."""
    uvicorn.run(app, host=host, port=port, log_level="info", http=header_timeout_protocol(read_timeout))
    return 0


def serve(app, engine: AsyncEngine, host: str, port: int, read_timeout: float, shutdown_grace: float) -> int:
    """Serve until SIGTERM (exit status 0) or the engine's death (1); Ctrl-C raises KeyboardInterrupt."""
    config = uvicorn.Config(app, host=host, port=port, log_level="info", http=header_timeout_protocol(read_timeout),
                            timeout_graceful_shutdown=shutdown_grace)  # fmt: skip
    server = DrainingServer(config, engine)

    def engine_died(error: BaseException) -> None:  # on the engine's thread, or the watchdog's
        log.critical("the engine died (%r): stopping the server, exit status %d", error, EXIT_ENGINE_DIED)
        server.should_exit = True

    engine.on_fatal = engine_died
    if engine.fatal is not None:  # it died before it had someone to tell
        return EXIT_ENGINE_DIED
    # uvicorn raises the signal it stopped for again once it has drained; a SIGTERM handled this way is
    # a clean stop (exit 0), so it is ignored then rather than killing the process.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if in_main else None
    try:
        server.run()
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_ENGINE_DIED if engine.fatal is not None else 0
