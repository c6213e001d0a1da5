"""`qwen3-serve` as a process, the way a supervisor sees it: SIGTERM drains it and it exits 0; when
its engine dies (a step raises, or hangs past --step-timeout), the requests in it fail at once with 500
and it exits 1, to be restarted (server/process.py).

Each test starts the real command on a free port (scripts/server_process.py's start_server) over a
tiny checkpoint.
"""

import asyncio
import signal
import sys

import httpx
import pytest
from make_tiny_checkpoint import make_tiny_checkpoint
from server_process import start_server

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
POISON = [7, 7, 7]
# The command with one bug planted: the scheduler (state shared by every request) breaks once a
# request whose prompt starts with POISON is waiting, as a real bug in shared state would.
BROKEN_SERVE = [sys.executable, "-c", f"""
import sys
from qwen3_scratch.engine.scheduler import Scheduler
schedule = Scheduler.schedule
def broken(self):
    if any(seq.token_ids[:3] == {POISON} for seq in self.waiting):
        raise RuntimeError("injected: the scheduler broke")
    return schedule(self)
Scheduler.schedule = broken
from qwen3_scratch.cli.serve import main
sys.exit(main(sys.argv[1:]))
"""]

HANG = [8, 8, 8]
# The command with a hang planted: the forward blocks forever once a request whose prompt starts with
# HANG is in the batch, as a deadlocked collective or a wedged device would.
HUNG_SERVE = [sys.executable, "-c", f"""
import sys, threading
from qwen3_scratch.engine.model_runner import ModelRunner
run = ModelRunner.run
def hung(self, batch):
    if any(chunk.seq.token_ids[:3] == {HANG} for chunk in batch.decodes + batch.prefills):
        threading.Event().wait()
    return run(self, batch)
ModelRunner.run = hung
from qwen3_scratch.cli.serve import main
sys.exit(main(sys.argv[1:]))
"""]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("process") / "tiny"))


async def stream(client, max_tokens, started: asyncio.Event):
    """Stream a completion; returns (events received, whether it ended with [DONE])."""
    body = {"model": "m", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    events.append(line)
                    started.set()
    except httpx.HTTPError:  # the connection was cut: an aborted request
        pass
    return len(events), events[-1:] == ["data: [DONE]"]


def test_sigterm_finishes_short_requests_aborts_long_ones_within_the_grace_and_exits_0(checkpoint):
    flags = ["--served-model-name", "m", "--num-blocks", "256", "--shutdown-grace", "2"]
    process, url = start_server(checkpoint, flags, API_KEY)

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            # Warm first: a cold server's first decode steps build the CPU attention kernel (seconds on a
            # busy host), which would eat the grace period; this test is about draining, not about that.
            await asyncio.gather(*(stream(client, 4, asyncio.Event()) for _ in range(2)))
            short_started, long_started = asyncio.Event(), asyncio.Event()
            short = asyncio.create_task(stream(client, 24, short_started))
            long = asyncio.create_task(stream(client, 2000, long_started))
            await short_started.wait()
            await long_started.wait()
            process.send_signal(signal.SIGTERM)
            return await short, await long

    try:
        (short_events, short_done), (long_events, long_done) = asyncio.run(run())
        status = process.wait(timeout=30)
    finally:
        process.kill()
    assert short_done, "a request in flight at SIGTERM finishes within the grace period"
    assert not long_done and long_events < 2000, "one that would run past the grace period is aborted"
    assert status == 0, f"exit status {status}: {process.stderr.read()[-2000:]}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=1)


def test_a_dead_engine_fails_requests_at_once_and_the_process_exits_1(checkpoint):
    process, url = start_server(checkpoint, ["--served-model-name", "m"], API_KEY, serve=BROKEN_SERVE)
    try:
        killer = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": POISON, "max_tokens": 2},
                            headers=AUTH, timeout=1)  # fmt: skip
        assert killer.status_code == 500 and killer.json()["error"]["code"] == "engine_dead", killer.text
        status = process.wait(timeout=30)
    finally:
        process.kill()
    stderr = process.stderr.read()
    assert status == 1, f"exit status {status}, not 1: a supervisor would not restart it. {stderr[-2000:]}"
    assert "the engine died" in stderr and "injected: the scheduler broke" in stderr


def test_a_step_that_hangs_past_the_step_timeout_fails_its_requests_and_the_process_exits_1(checkpoint):
    flags = ["--served-model-name", "m", "--step-timeout", "1"]
    process, url = start_server(checkpoint, flags, API_KEY, serve=HUNG_SERVE)
    try:
        hung = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": HANG, "max_tokens": 2},
                          headers=AUTH, timeout=30)  # fmt: skip
        assert hung.status_code == 500 and hung.json()["error"]["code"] == "engine_dead", hung.text
        status = process.wait(timeout=30)
    finally:
        process.kill()
    stderr = process.stderr.read()
    assert status == 1, f"exit status {status}, not 1: a supervisor would not restart it. {stderr[-2000:]}"
    assert "--step-timeout" in stderr and ", in hung" in stderr, f"the log says it hung, and where: {stderr[-3000:]}"
