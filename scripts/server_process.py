"""`qwen3-serve` as a child process of a script: start it, wait until it answers, stop it.

soak.py, lm_eval_compare.py and readme_demos.py (and tests/test_serve_process.py) run the real command
this way, so each start waits on GET /health the same way and says the same thing when the server dies
first or never answers.
"""

import signal
import socket
import subprocess
import sys
import time

import httpx

SERVE = [sys.executable, "-m", "qwen3_scratch.serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(process: subprocess.Popen, url: str, timeout: float) -> None:
    """Return once GET {url}/health answers 200. RuntimeError if the process exits first (with the end of
    its stderr when that is piped) or, the process killed, if it has not answered in `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr = process.stderr.read()[-2000:] if process.stderr else ""
            raise RuntimeError(f"the server exited with {process.returncode}: {stderr}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not answer {url}/health within {timeout:g} s")


def start_server(model: str, extra: list[str], api_key: str | None = None, timeout: float = 120.0,
                 serve: list[str] = SERVE) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """`python -m qwen3_scratch.serve` (or `serve`, taking the same flags) on a free port; returns
    (process, url) once /health answers."""
    port = free_port()
    command = [*serve, "--model", model, "--port", str(port), *extra]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(process, url, timeout)
    return process, url


def stop_server(process: subprocess.Popen, grace: float) -> tuple[int | None, float]:
    """SIGTERM, then (exit status, seconds it took); None if it had to be killed."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(timeout=grace + 30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        status = None
    return status, time.monotonic() - started
