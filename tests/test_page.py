"""The chat page and the engine view, over HTTP without a browser: what is served, to whom, and what
/engine/state says about a real engine (tests/test_page_browser.py drives the page itself).

One scripted server for the module (tests/scripted_server.py): the real engine on 127.0.0.1 with an
API key, its replies forced to known tokens and its steps slowed where a test must catch a request
running.
"""

import re
import threading
import time
from importlib.resources import files

import httpx
import pytest
from make_tiny_checkpoint import make_tiny_checkpoint
from scripted_server import API_KEY, AUTH, BLOCK_SIZE, MODEL, NUM_BLOCKS, SYSTEM, reset_around, scripted_server
from server_process import start_server, stop_server

from qwen3_scratch.engine.snapshot import block_state



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with scripted_server(make_tiny_checkpoint(tmp_path_factory.mktemp("page") / "tiny")) as served:
        yield served


served = pytest.fixture(reset_around)


def chat(system: str, question: str, max_tokens: int = 200) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip


def stream_in_background(url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    """POST a streamed chat on a thread; returns it and the list its `data:` lines are added to."""
    lines: list[str] = []

    def run():
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line.startswith("data:"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, lines


def state(url: str) -> dict:
    response = httpx.get(f"{url}/engine/state", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_state(url: str, condition, seconds: float = 30.0) -> dict:
    """The first /engine/state for which condition holds (polled, as the page does)."""
    deadline = time.monotonic() + seconds
    while True:
        now = state(url)
        if condition(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


# -- what is served -------------------------------------------------------------------------------


def test_the_page_and_the_engine_view_are_html_that_loads_only_this_servers_script_and_styles(server):
    for path in ("/", "/engine"):
        page = httpx.get(server.url + path)
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8", path
        assert '<script src="/static/app.js"' in page.text and 'href="/static/style.css"' in page.text
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy, "no inline or foreign script runs"
    script = httpx.get(f"{server.url}/static/app.js")
    assert script.headers["content-type"].startswith("text/javascript") and "function calculate" in script.text
    assert httpx.get(f"{server.url}/static/style.css").headers["content-type"].startswith("text/css")


def test_the_page_fetches_nothing_from_the_internet():
    for path in (files("qwen3_scratch.server") / "static").iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), f"{path.name} names a host"
        assert "@import" not in text and "url(" not in text, f"{path.name} loads another file"


def test_only_the_pages_own_files_are_served_from_static(server):
    for name in ("index.html", "../app.py", "..%2Fapp.py", "nothing.js"):
        response = httpx.get(f"{server.url}/static/{name}")
        assert response.status_code == 404, f"/static/{name} answered {response.status_code}"
        assert "error" in response.json()


def test_the_page_needs_no_key_but_the_engine_state_does_as_v1_does(server):
    assert httpx.get(server.url + "/").status_code == 200, "the page must load to ask for the key"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(f"{server.url}/engine/state", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/engine/state", headers=AUTH).status_code == 200


def test_the_qwen3_serve_command_serves_the_page_and_the_engine_state(server):
    flags = ["--served-model-name", MODEL, "--num-blocks", "32"]
    process, url = start_server(str(server.llm.checkpoint), flags, API_KEY)
    try:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "<title>qwen3-scratch</title>" in page.text
        assert httpx.get(f"{url}/engine/state").status_code == 401
        pool = httpx.get(f"{url}/engine/state", headers=AUTH).json()["pool"]
        assert pool["num_blocks"] == len(pool["states"]) == pool["free"] == 32
    finally:
        assert stop_server(process, grace=5)[0] == 0, process.stderr.read()[-2000:]


def test_without_an_api_key_the_engine_state_is_open(tmp_path):
    with scripted_server(make_tiny_checkpoint(tmp_path / "tiny"), api_key=None) as open_server:
        assert httpx.get(f"{open_server.url}/engine/state").status_code == 200


# -- what the engine state says --------------------------------------------------------------------


def test_block_states_are_free_cached_in_use_and_shared():
    assert [block_state(0, False), block_state(0, True), block_state(1, True), block_state(2, True)] == list(".cus")


def test_the_state_shows_a_running_request_its_blocks_and_after_it_the_cached_prefix(served):
    idle = state(served.url)
    assert idle["model"] == MODEL and idle["running"] == idle["waiting"] == []
    assert idle["pool"]["num_blocks"] == len(idle["pool"]["states"]) == NUM_BLOCKS
    assert idle["pool"]["block_size"] == BLOCK_SIZE and idle["pool"]["used"] == idle["pool"]["shared"] == 0
    served.runner.delay = 0.05
    served.script("The cache keeps the keys and values. " * 12)
    thread, lines = stream_in_background(served.url, chat(SYSTEM, "Tell me about caches."))
    busy = wait_for_state(served.url, lambda s: s["running"] and s["running"][0]["output_tokens"] > 2)
    (seq,) = busy["running"]
    prompt = len(served.runner.prompts[0])
    assert seq["id"].startswith("chatcmpl-") and seq["prompt_tokens"] == prompt and seq["cached_tokens"] == 0
    assert seq["max_tokens"] == 200 and seq["computed_tokens"] >= prompt
    assert len(seq["blocks"]) == -(-(prompt + seq["output_tokens"]) // BLOCK_SIZE), "a block per 16 tokens held"
    pool = busy["pool"]
    assert [pool["states"][b] for b in seq["blocks"]] == ["u"] * len(seq["blocks"]), "one request: none shared"
    assert pool["used"] == len(seq["blocks"])
    assert sum(pool[k] for k in ("free", "cached", "used", "shared")) == NUM_BLOCKS, "each block in one state"
    assert busy["tokens_per_second"] > 0
    served.runner.delay = 0
    thread.join(30)
    assert lines[-1] == "data: [DONE]"
    done = wait_for_state(served.url, lambda s: not s["running"])
    assert done["pool"]["used"] == 0 and done["pool"]["cached"] >= prompt // BLOCK_SIZE, "its full blocks stay cached"


def test_two_requests_with_the_same_system_prompt_show_its_blocks_shared(served):
    served.runner.delay = 0.05
    served.script("The first answer goes on and on. " * 12)
    served.script("The second answer goes on and on. " * 12)
    first, _ = stream_in_background(served.url, chat(SYSTEM, "What is a cache?"))
    wait_for_state(served.url, lambda s: s["running"] and s["running"][0]["output_tokens"] > 0)
    second, _ = stream_in_background(served.url, chat(SYSTEM, "And a block table?"))
    both = wait_for_state(served.url, lambda s: len(s["running"]) == 2 and s["running"][1]["output_tokens"] > 0)
    a, b = served.runner.prompts
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the system prompt and the turn's header
    shared = common // BLOCK_SIZE
    assert shared >= 3, f"the system prompt fills {shared} blocks: make it longer"
    assert both["pool"]["shared"] == shared, f"{both['pool']} for a common prefix of {common} tokens"
    tables = [seq["blocks"] for seq in both["running"]]
    assert tables[0][:shared] == tables[1][:shared], "both tables start with the same blocks"
    assert both["running"][1]["cached_tokens"] == shared * BLOCK_SIZE
    served.runner.delay = 0
    first.join(30)
    second.join(30)
