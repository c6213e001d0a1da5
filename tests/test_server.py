"""The OpenAI-compatible server, driven by the real `openai` client on 127.0.0.1 (tiny checkpoint).

One server for the module, in-process on its own thread, with an API key. Greedy replies are checked
against the simple loop (generation/loops.py) run alone and parsed by chat_parser; reasoning and tool calls
are checked with a scripted model that forces known tokens out of the real engine.
"""

import asyncio
import json
import sys
import time

import httpx
import openai
import pytest
import torch
from make_tiny_checkpoint import make_tiny_checkpoint
from openai_server import uvicorn_thread

from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.server.app import build_app
from qwen3_scratch.server.async_engine import AsyncEngine
from qwen3_scratch.text.chat_parser import parse_assistant

API_KEY = "test-key"
MODEL = "tiny-qwen3"
NUM_BLOCKS = 512


class ScriptedModel:
    """The real model, except that while `script` = (prompt length, ids) is set, the output tokens at
    those positions are forced to `ids` (the model still runs and fills the cache as usual)."""

    def __init__(self, model):
        self.model, self.script, self.fail = model, None, False

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, position_ids, *args, **kwargs):
        if self.fail:
            raise RuntimeError("injected failure")
        logits = self.model(input_ids, position_ids, *args, **kwargs)  # (1, M, V): one row per kept token
        if self.script is not None:
            start, ids = self.script
            kept = position_ids[0, kwargs["logits_at"]]  # the positions whose next token each row predicts
            for row, index in enumerate((kept + 1 - start).tolist()):
                if 0 <= index < len(ids):
                    logits[0, row] = float("-inf")
                    logits[0, row, ids[index]] = 0.0
        return logits


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds waits on a shared 2-core machine
    llm = LLM(str(make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")), num_blocks=NUM_BLOCKS)
    llm.engine.runner.model = ScriptedModel(llm.model)
    engine = AsyncEngine(llm.engine).start()
    app = build_app(engine, llm.tokenizer, MODEL, llm.get_default_sampling_params(), api_key=API_KEY)
    try:
        with uvicorn_thread(app) as url:
            yield llm, url
    finally:
        engine.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key=API_KEY, max_retries=0)


def alone(llm, ids, max_tokens):
    """The reference: the request run alone through the simple KV-cache loop."""
    steps = generate_tokens(llm.model, [ids], max_tokens, LogitsFilter(temperature=0.0), llm.eos_ids)
    return [int(t[0]) for t in steps]


def script(llm, messages, text, tools=None):
    """Force the reply to `text` (+ <|im_end|>) for these messages."""
    prompt = llm.tokenizer.chat_ids(messages, tools=tools)
    llm.engine.runner.model.script = (len(prompt), llm.tokenizer.encode(text) + llm.eos_ids[:1])


@pytest.fixture
def scripted(server):
    yield server[0]
    server[0].engine.runner.model.script = None
    server[0].engine.runner.model.fail = False


def all_blocks_free(llm):
    return llm.engine.blocks.num_free == NUM_BLOCKS and not llm.engine.has_unfinished()


# -- chat, completions, streaming -------------------------------------------------------------------


def test_greedy_chat_reply_is_the_simple_loops_parsed(server, client):
    llm = server[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    expected_ids = alone(llm, llm.tokenizer.chat_ids(messages), 24)
    expected = parse_assistant(expected_ids, llm.tokenizer)
    assert reply.choices[0].message.content == expected["content"]
    assert reply.choices[0].finish_reason == ("stop" if expected_ids[-1] in llm.eos_ids else "length")
    assert reply.usage.prompt_tokens == len(llm.tokenizer.chat_ids(messages))
    assert reply.usage.completion_tokens == len(expected_ids)


def test_streamed_chat_adds_up_to_the_whole_reply_and_ends_with_done(server, client):
    messages = [{"role": "user", "content": "Tell me about the weather."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "stream": True}
    raw = httpx.post(f"{server[1]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    events = [line for line in raw.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_reasoning_is_kept_apart_from_the_answer_in_messages_and_stream_deltas(scripted, client):
    messages = [{"role": "user", "content": "Greet me."}]
    script(scripted, messages, "<think>\nThe user wants a greeting.\n</think>\n\nHello there!")
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    message = reply.choices[0].message
    assert message.content == "Hello there!"
    assert message.reasoning_content == message.reasoning == "The user wants a greeting."
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants a greeting."
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "The user wants a greeting."
    assert "".join(d.content or "" for d in deltas) == "Hello there!"


def test_a_stop_string_ends_the_chat_answer_before_it_whole_and_streamed(scripted, client):
    messages = [{"role": "user", "content": "Count."}]
    script(scripted, messages, "One two STOP three four")
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=["STOP"])
    assert reply.choices[0].message.content == "One two " and reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                            stop=["STOP"], stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "One two "


def test_min_tokens_holds_back_a_stop_string_in_the_chat_answer_whole_and_streamed(scripted, client):
    """The first newline is the 4th token: with min_tokens=4 it is ignored, though the parser holds it back
    until the 5th token comes, and the answer ends before the next one (the 8th token)."""
    messages = [{"role": "user", "content": "Lines."}]
    script(scripted, messages, "One\ntwo\nthree\nfour")
    for min_tokens, answer, tokens in ((0, "One", 4), (4, "One\ntwo", 8)):
        request = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=["\n"],
                       extra_body={"min_tokens": min_tokens})  # fmt: skip
        reply = client.chat.completions.create(**request)
        assert (reply.choices[0].message.content, reply.usage.completion_tokens) == (answer, tokens), min_tokens
        assert reply.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(**request, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def test_tool_calls_come_back_parsed_whole_and_streamed(scripted, client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    script(scripted, messages, call, tools=TOOLS)
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
    (tool_call,) = reply.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.usage.prompt_tokens == len(scripted.tokenizer.chat_ids(messages, tools=TOOLS)), "tools in the prompt"
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60,
                                            temperature=0, stream=True)  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].finish_reason == "tool_calls"


def test_completions_whole_and_streamed_equal_the_simple_loop(server, client):
    llm = server[0]
    prompt = "def greet(name"
    expected = llm.tokenizer.decode(alone(llm, llm.tokenizer.encode(prompt), 12), skip_special_tokens=True)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    longer = llm.tokenizer.decode(alone(llm, llm.tokenizer.encode(prompt), 20), skip_special_tokens=True)
    assert "e model" in longer, f"the tiny model's greedy text changed: {longer!r}"
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=["e model"])
    assert stopped.choices[0].text == longer[: longer.find("e model")]
    assert stopped.choices[0].finish_reason == "stop"


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server[1]}/health").status_code == 200
    metrics = httpx.get(f"{server[1]}/metrics").text
    for name in ("qwen3_num_requests_running", "qwen3_num_requests_waiting", "qwen3_kv_blocks_used",
                 "qwen3_prefix_cache_hit_rate", "qwen3_time_to_first_token_seconds_bucket",
                 "qwen3_time_per_output_token_seconds_bucket", "qwen3_generation_tokens_per_second"):  # fmt: skip
        assert f"\n{name}" in metrics, f"/metrics lacks {name}"


# -- errors ---------------------------------------------------------------------------------------


BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"model": "tiny-qwen3", "messages": [', 400),
    "unknown model": ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    "negative temperature": ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    "top_p above 1": ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400),
    "max_tokens 0": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    "prompt over the context": ("/v1/completions", {"model": MODEL, "prompt": list(range(3000)), "max_tokens": 1}, 400),
    "messages not a list": ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 422),
    "missing prompt": ("/v1/completions", {"model": MODEL}, 422),
    "n above 128": ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}, 400),
    "unknown route": ("/v1/rerank", {"model": MODEL, "input": "hi"}, 404),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_error_bodies(server, case):
    path, body, status = BAD_REQUESTS[case]
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server[1]}{path}", content=content, headers=headers)
    assert response.status_code == status, f"{case}: {response.text}"
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] is not None, error
    assert "Traceback" not in response.text


def test_the_openai_client_raises_its_own_error_types(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=1)


def test_an_engine_failure_is_a_500_error_body_and_the_server_keeps_serving(scripted, client, server):
    scripted.engine.runner.model.fail = True
    response = httpx.post(f"{server[1]}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)  # fmt: skip
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"].startswith("the engine failed this request (RuntimeError)")
    assert "Traceback" not in response.text
    scripted.engine.runner.model.fail = False
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0).usage.completion_tokens >= 1
    assert all_blocks_free(scripted)


def test_the_api_key_is_required(server):
    bad = openai.OpenAI(base_url=f"{server[1]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    response = httpx.get(f"{server[1]}/v1/models")  # no Authorization header at all
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server):
    llm = server[0]
    aborted = llm.engine.num_aborted
    body = {"model": MODEL, "prompt": "hello " * 40, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server[1]}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:  # fmt: skip
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert llm.engine.blocks.num_used > 0, "the request is running"
    deadline = time.monotonic() + 60  # a bound for a broken server, not a speed check
    while not all_blocks_free(llm) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all_blocks_free(llm), "the disconnected request still holds blocks"
    assert llm.engine.num_aborted == aborted + 1, "it was aborted, not run to its 1500 tokens"


def test_serve_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    from qwen3_scratch.cli.serve import main

    assert main(["--model", str(tmp_path / "missing"), "--local-files-only"]) == 2
    assert main(["--model", str(tmp_path), "--block-size", "0"]) == 2
    with pytest.raises(SystemExit) as exit_:  # argparse's own errors are one line and exit 2 too
        main(["--model", str(tmp_path), "--port", "eighty"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("qwen3-serve: error: ") for line in lines), lines
    assert "block-size" in lines[1] and "--port" in lines[2]


def test_serve_without_the_serve_extra_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import builtins

    from qwen3_scratch.cli.serve import main

    real_import = builtins.__import__

    def no_fastapi(name, *args, **kwargs):
        if name in ("uvicorn", "fastapi") or name.startswith("fastapi."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    monkeypatch.delitem(sys.modules, "qwen3_scratch.server.app", raising=False)
    assert main(["--model", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert 'pip install -e ".[serve]"' in line, line


# -- load ------------------------------------------------------------------------------------------


def test_64_requests_from_16_clients_all_answered_like_the_simple_loop(server):
    """Mixed prompt and output lengths, half behind one long shared system prompt."""
    llm, url = server
    g = torch.Generator().manual_seed(0)
    words = "cache token model block prefix batch step queue answer reason".split()
    system = " ".join(words[i] for i in torch.randint(0, 10, (160,), generator=g).tolist())
    requests = []
    for i in range(64):
        user = " ".join(words[i] for i in torch.randint(0, 10, (int(torch.randint(1, 60, (1,), generator=g)),),
                                                         generator=g).tolist())  # fmt: skip
        messages = ([{"role": "system", "content": system}] if i % 2 == 0 else []) + [{"role": "user", "content": user}]
        requests.append((messages, int(torch.randint(1, 40, (1,), generator=g))))
    hits_before = llm.engine.blocks.hit_tokens
    replies = asyncio.run(ask_all(url, requests, concurrency=16))
    assert len(replies) == 64 and all(r is not None for r in replies), "every request answered"
    for (messages, max_tokens), reply in zip(requests, replies):
        expected_ids = alone(llm, llm.tokenizer.chat_ids(messages), max_tokens)
        expected = parse_assistant(expected_ids, llm.tokenizer)
        assert reply.choices[0].message.content == expected["content"], f"reply to {messages[-1]['content'][:40]!r}"
        assert reply.usage.completion_tokens == len(expected_ids)
    shared = [r.usage.prompt_tokens_details.cached_tokens for r, (m, _) in zip(replies, requests) if len(m) == 2]
    assert sum(c > 0 for c in shared) >= 16, f"the shared system prompt must hit the prefix cache: {shared}"
    assert llm.engine.blocks.hit_tokens > hits_before
    assert all_blocks_free(llm), "every KV block is back in the pool"


async def ask_all(url, requests, concurrency):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    gate = asyncio.Semaphore(concurrency)

    async def ask(messages, max_tokens):
        async with gate:
            return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                        temperature=0)  # fmt: skip

    try:
        return await asyncio.gather(*(ask(m, n) for m, n in requests))
    finally:
        await client.close()
