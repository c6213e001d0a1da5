"""A server that one request cannot take down: hostile input, a fault inside the engine, a dead engine.

Every case issue 20 found against the server is here, sent the way a client sends it (httpx, raw
sockets for slow clients), against a real uvicorn server on a thread; after each, the server still
answers a normal request and /health tells the truth. Engine faults are injected by FaultyRunner
(tests/live_server.py): the forward raises for requests whose prompt starts with POISON, and blocks
(a step that hangs) for those starting with HANG.
"""

import asyncio
import json
import select
import socket
import time

import httpx
import pytest
import torch
from live_server import API_KEY, HANG, MODEL, POISON, all_blocks_free, live_server, nothing_held, wait_until
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.sampling.logits import LogitsFilter

AUTH = {"Authorization": f"Bearer {API_KEY}"}
READ_TIMEOUT = 1.0  # seconds for headers, and again for the body, in this module's server
MAX_BODY = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "tiny")


@pytest.fixture(scope="module")
def served(checkpoint):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared 2-core machine
    with live_server(checkpoint, read_timeout=READ_TIMEOUT, max_body_bytes=MAX_BODY) as (llm, engine, url):
        yield llm, engine, url
    torch.set_num_threads(threads)


def post(url, path, body, timeout=30.0, **kwargs):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout, **kwargs)


def chat(content="hi", **fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def assert_still_serving(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    reply = post(url, "/v1/chat/completions", chat(temperature=0))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1, reply.text


def alone(llm, ids, max_tokens):
    steps = generate_tokens(llm.model, [ids], max_tokens, LogitsFilter(temperature=0.0), llm.eos_ids)
    return [int(t[0]) for t in steps]


# -- values and shapes, refused where the request is parsed ---------------------------------------


REFUSED = {
    "seed 2**70 (killed the engine thread before)": (chat(seed=2**70), 400, "seed"),
    "negative seed": (chat(seed=-1), 400, "seed"),
    "role wizard (answered 200 before)": ({**chat(), "messages": [{"role": "wizard", "content": "hi"}]}, 422, "role"),
    "role developer": ({**chat(), "messages": [{"role": "developer", "content": "hi"}]}, 422, "role"),
    "content an object": ({**chat(), "messages": [{"role": "user", "content": {"a": 1}}]}, 422, "content"),
    "content missing": ({**chat(), "messages": [{"role": "user"}]}, 422, "content"),
    "an image part": ({**chat(), "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                      422, "messages"),  # fmt: skip
    "tool_calls on a user message": ({**chat(), "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 422, "tool_calls"),  # fmt: skip
    "a tool call without a name": ({**chat(), "messages": [{"role": "assistant", "content": None,
                                    "tool_calls": [{"type": "function", "function": {}}]}]}, 422, "name"),  # fmt: skip
    "a tool without a function": (chat(tools=[{"type": "function"}]), 422, "function"),
    "stop_token_ids past the vocabulary": (chat(stop_token_ids=[2**31 - 1]), 400, "stop_token_ids"),
    "max_tokens 2**70": (chat(max_tokens=2**70), 400, "KV blocks"),
    "include_usage a string": (chat(stream=True, stream_options={"include_usage": "yes"}), 422, "include_usage"),
    "enable_thinking a string": (chat(chat_template_kwargs={"enable_thinking": "no"}), 422, "enable_thinking"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_values_and_shapes_are_refused_with_an_error_that_names_them(served, case):
    body, status, named = REFUSED[case]
    response = post(served[2], "/v1/chat/completions", body)
    assert response.status_code == status, f"{case}: {response.text}"
    assert named in response.json()["error"]["message"], response.text


def test_after_the_2_70_seed_the_engine_serves_on_and_health_is_ok(served):
    assert post(served[2], "/v1/chat/completions", chat(seed=2**70)).status_code == 400
    assert_still_serving(served[2])


# -- hostile bodies: bounded size, depth, time and text -------------------------------------------


def deep(n):
    return b"[" * n + b"]" * n


HOSTILE_BODIES = {
    "100,000-deep array": (deep(100_000), 400, "too_deep"),
    "900-deep tool schema (a RecursionError, 500, before)": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
        b'"function": {"name": "f", "parameters": {"a": %s}}}]}' % (MODEL.encode(), deep(900)), 400, "too_deep"),
    "invalid UTF-8": (b'{"model": "%s", "messages": [{"role": "user", "content": "\xff\xfe"}]}' % MODEL.encode(),
                      400, "invalid_utf8"),  # fmt: skip
    "a lone surrogate in content (a TypeError, 500, before)": (
        b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}]}' % MODEL.encode(), 400,
        "invalid_unicode"),
    "malformed JSON": (b'{"model": "x", "messages": [', 400, "invalid_json"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BODIES))
def test_hostile_bodies_get_a_clean_4xx_and_the_server_serves_on(served, case):
    body, status, code = HOSTILE_BODIES[case]
    response = post(served[2], "/v1/chat/completions", body, timeout=10)
    assert response.status_code == status and response.json()["error"]["code"] == code, f"{case}: {response.text}"
    assert_still_serving(served[2])


def test_a_surrogate_pair_is_text_and_passes(served):
    emoji = json.dumps(chat("smile \U0001f600", temperature=0))  # ensure_ascii: written as \ud83d\ude00
    assert "\\ud83d\\ude00" in emoji
    assert post(served[2], "/v1/chat/completions", emoji.encode()).status_code == 200


def test_a_body_over_the_limit_is_refused_before_it_is_read(served):
    url = served[2]
    response = post(url, "/v1/completions", b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}', timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    # Content-Length says 50 MB and not one byte of the body follows: the 413 comes anyway.
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {50 * 2**20}\r\n\r\n".encode())  # fmt: skip
        assert s.recv(4096).startswith(b"HTTP/1.1 413 ")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(4):
            yield b"a" * (MAX_BODY // 2)

    response = httpx.post(f"{url}/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert response.status_code == 413
    assert_still_serving(url)


def test_a_body_that_never_ends_is_answered_413_and_cut_off(served):
    url = served[2]
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())  # fmt: skip
        chunk = b"%x\r\n%s\r\n" % (2**16, b"a" * 2**16)
        answer, started, cut = b"", time.monotonic(), False
        try:  # the answer comes while the client still sends; the server drops what follows, then cuts it off
            while time.monotonic() - started < 10 * READ_TIMEOUT:
                s.sendall(chunk)
                if select.select([s], [], [], 0.02)[0]:
                    answer += s.recv(4096)
        except ConnectionError:
            cut = True
        assert answer.startswith(b"HTTP/1.1 413 ") and cut, (answer[:40], cut)
    assert_still_serving(url)


def test_a_client_that_sends_its_headers_slowly_is_cut_off(served):
    url = served[2]
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        started = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.1)  # each byte well inside uvicorn's keep-alive clock, which restarts on every byte
            except OSError:
                closed = True
                break
            if time.monotonic() - started > 10 * READ_TIMEOUT:
                break
        if not closed:
            s.settimeout(READ_TIMEOUT)
            closed = s.recv(1) == b""
        assert closed, "a connection trickling its headers was held open"
    assert_still_serving(url)


def test_a_client_that_sends_its_body_slowly_gets_408(served):
    url = served[2]
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mod".encode())  # fmt: skip
        assert s.recv(4096).startswith(b"HTTP/1.1 408 ")
    assert_still_serving(url)


# -- a fault inside the engine stays with its request -----------------------------------------------


def test_a_fault_in_one_requests_forward_fails_it_alone_while_the_others_finish_like_the_simple_loop(served):
    llm, engine, url = served
    failed_before = llm.engine.num_failed
    prompts = [llm.tokenizer.encode(p) for p in ("Once upon a time", "def greet(name", "The cache", "Blocks and")]

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            def ask(prompt, stream=False):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": stream}
                return client.post("/v1/completions", json=body)
            return await asyncio.gather(*(ask(p) for p in prompts), ask(POISON + [11, 12]),
                                        ask(POISON + [13], stream=True))  # fmt: skip

    *normal, poisoned, poisoned_stream = asyncio.run(run())
    assert poisoned.status_code == 500, poisoned.text
    error = poisoned.json()["error"]
    assert error["type"] == "internal_server_error" and "RuntimeError" in error["message"]
    request_id = error["message"].rsplit(" ", 1)[-1]
    assert request_id.startswith("cmpl-"), f"the message names the id to look for in the log: {error}"
    events = [line for line in poisoned_stream.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and "internal_server_error" in events[-2], events
    for prompt, reply in zip(prompts, normal):
        assert reply.status_code == 200, reply.text
        expected = llm.tokenizer.decode(alone(llm, prompt, 24), skip_special_tokens=True)
        assert reply.json()["choices"][0]["text"] == expected, "a neighbour of the fault got other tokens"
    assert llm.engine.num_failed == failed_before + 2
    assert wait_until(lambda: all_blocks_free(llm)), "the failed requests' blocks are back in the pool"
    assert "qwen3_num_requests_failed_total 2.0" in httpx.get(f"{url}/metrics").text
    assert_still_serving(url)


def test_a_bug_in_a_route_after_its_stream_began_ends_the_stream_with_an_error_event(served, monkeypatch):
    from qwen3_scratch.server import choices

    def broken(*args, **kwargs):
        raise KeyError("a bug in the route")

    monkeypatch.setattr(choices.ChatChoice, "push", broken)
    streamed = post(served[2], "/v1/chat/completions", chat(stream=True))
    events = [line for line in streamed.text.splitlines() if line]
    assert streamed.status_code == 200 and events[-1] == "data: [DONE]" and "Traceback" not in streamed.text, events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "internal_server_error" and "KeyError" in error["message"]
    monkeypatch.undo()
    assert wait_until(lambda: all_blocks_free(served[0]))
    assert_still_serving(served[2])


def test_a_request_past_its_deadline_gets_504_and_frees_its_blocks(served):
    llm, engine, url = served
    engine.request_timeout = 0.3
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True}
        response = post(url, "/v1/completions", body)
        assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout", response.text
        streamed = post(url, "/v1/completions", {**body, "stream": True})
        events = [line for line in streamed.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and "request_timeout" in events[-2]
        assert wait_until(lambda: all_blocks_free(llm))
    finally:
        engine.request_timeout = None
    assert_still_serving(url)


def test_a_client_that_drops_mid_stream_frees_its_blocks(served):
    llm, _, url = served
    body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as response:
        assert next(response.iter_lines()).startswith("data: ")
    assert wait_until(lambda: all_blocks_free(llm)), "the dropped request still holds blocks"
    assert_still_serving(url)


# -- a dead engine: 500 for the requests in it, 503 for new ones, /health says so -------------------


def test_a_dead_engine_fails_requests_in_flight_and_new_ones_at_once_and_health_turns_503(checkpoint):
    with live_server(checkpoint) as (llm, engine, url):
        told = []
        engine.on_fatal = told.append
        schedule = llm.engine.scheduler.schedule

        def broken_schedule():  # a bug in shared state, once a poisoned request is waiting
            if any(seq.token_ids[: len(POISON)] == POISON for seq in llm.engine.scheduler.waiting):
                raise RuntimeError("injected: the scheduler broke")
            return schedule()

        llm.engine.scheduler.schedule = broken_schedule
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as in_flight:
            lines = in_flight.iter_lines()
            assert next(lines).startswith("data: ")
            killer = post(url, "/v1/completions", {"model": MODEL, "prompt": POISON, "max_tokens": 2})
            assert killer.status_code == 500 and killer.json()["error"]["code"] == "engine_dead", killer.text
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "engine_dead" in rest[-2], "the stream in flight ends with the error"
        # on_fatal runs after the streams are told (in production it ends the process), so it may lag them
        assert wait_until(lambda: told), "on_fatal ran (the process would exit 1)"
        assert len(told) == 1 and "scheduler broke" in str(told[0])
        health = httpx.get(f"{url}/health", timeout=1)
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        for stream in (False, True):
            response = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": stream}, timeout=1)
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"


def test_a_step_that_hangs_fails_running_and_waiting_requests_with_500_and_health_turns_503(checkpoint):
    with live_server(checkpoint, step_timeout=0.5) as (llm, engine, url):
        told = []
        engine.on_fatal = told.append
        runner = llm.engine.runner  # FaultyRunner: a forward with a HANG request blocks until released
        try:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as in_flight:
                lines = in_flight.iter_lines()
                assert next(lines).startswith("data: ")

                async def hang_then_wait():  # the hanging request, then one that waits behind the stuck step
                    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client:
                        hanging = asyncio.create_task(client.post("/v1/completions", json={
                            "model": MODEL, "prompt": HANG, "max_tokens": 2}))  # fmt: skip
                        assert await asyncio.to_thread(runner.hung.wait, 30), "the step began to hang"
                        waiting = await client.post("/v1/chat/completions", json=chat())
                        return await hanging, waiting

                started = time.monotonic()
                hanging, waiting = asyncio.run(hang_then_wait())
                rest = [line for line in lines if line]
            for response in (hanging, waiting):
                assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead", response.text
            assert rest[-1] == "data: [DONE]" and "engine_dead" in rest[-2], "the stream in flight ends with the error"
            assert time.monotonic() - started < 20, "the requests were failed by the watchdog, not by a client timeout"
            assert len(told) == 1 and "--step-timeout" in str(told[0]), told
            assert "hang_then_wait" not in str(told[0]) and "release.wait" in str(told[0]), "it names where it hangs"
            health = httpx.get(f"{url}/health", timeout=1)
            assert health.status_code == 503 and health.json() == {"status": "dead"}
            response = post(url, "/v1/chat/completions", chat(), timeout=1)
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
        finally:
            runner.release.set()  # let the stuck thread end with the test


def test_after_every_hostile_request_above_nothing_is_held(served):
    llm, engine, _ = served
    assert wait_until(lambda: nothing_held(llm, engine)), "a request left state behind"


def test_a_draining_server_refuses_new_requests_with_503_and_says_so_on_health(served):
    engine, url = served[1], served[2]
    engine.draining = True
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        assert post(url, "/v1/chat/completions", chat()).status_code == 503
    finally:
        engine.draining = False
    assert_still_serving(url)
