"""OpenAI's API as clients use it, driven by the real `openai` client against one server (tiny checkpoint):
every request field implemented or refused by name, logprobs equal to the model's, n choices and prompt
lists, logit processing, and structured output that is valid by construction on random weights."""

import json
import typing

import openai
import pytest
import torch
from make_tiny_checkpoint import make_tiny_checkpoint
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai_server import serving
from pydantic import BaseModel, Field

from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.server.fields import CHAT, CHAT_VLLM, COMPLETIONS, VLLM
from qwen3_scratch.text.token_bytes import token_bytes

MODEL = "tiny-qwen3"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("api") / "tiny"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    """The reference: the same checkpoint in an engine of its own (the server's runs on its own thread)."""
    return LLM(checkpoint, num_blocks=256, dtype="float32")


@pytest.fixture(scope="module")
def client(checkpoint):
    with serving(LLM(checkpoint, num_blocks=256, dtype="float32"), MODEL) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def sdk_fields(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


SDK_CHAT = sdk_fields(chat_create_params.CompletionCreateParamsBase) | {"stream"}
SDK_COMPLETIONS = sdk_fields(completion_create_params.CompletionCreateParamsBase) | {"stream"}


def model_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's own logits over ids, straight from one forward: (T, V)."""
    return torch.log_softmax(llm.model(torch.tensor([ids]))[0].float(), dim=-1)


# -- no silent drops -------------------------------------------------------------------------------


def test_the_table_covers_every_field_of_the_installed_sdks_request_types():
    assert SDK_CHAT - set(CHAT) == set(), "chat fields the server neither implements nor refuses"
    assert SDK_COMPLETIONS - set(COMPLETIONS) == set(), "completions fields the server neither implements nor refuses"


def walk(route: str):
    table, sdk = (CHAT, SDK_CHAT) if route == "chat" else (COMPLETIONS, SDK_COMPLETIONS)
    extensions = CHAT_VLLM if route == "chat" else VLLM
    return [(route, name) for name in sorted(sdk)] + [(route, name) for name in sorted(extensions)]


@pytest.mark.parametrize("route, name", walk("chat") + walk("completions"))
def test_every_request_field_is_implemented_or_refused_naming_it(client, route, name):
    table = {**CHAT, **CHAT_VLLM} if route == "chat" else {**COMPLETIONS, **VLLM}
    field = table[name]
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], **NO_THINKING}
    base.update(chat if route == "chat" else {"prompt": "hi"})
    body = {**base, name: field.example}
    if name == "top_logprobs":
        body["logprobs"] = True
    if name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        body["max_tokens"] = 40
    create = client.chat.completions.create if route == "chat" else client.completions.create
    known = sdk_fields(chat_create_params.CompletionCreateParamsBase if route == "chat"
                       else completion_create_params.CompletionCreateParamsBase)  # fmt: skip
    extra = {k: body.pop(k) for k in list(body) if k not in known and k != "stream"}
    if field.status == "refused":
        with pytest.raises(openai.BadRequestError) as info:
            create(**body, extra_body=extra)
        assert info.value.param == name, info.value.body
        assert field.reason in info.value.message
    else:
        assert create(**body, extra_body=extra).choices, f"{name} ({field.status}) should be served"


def test_an_unknown_field_is_refused_naming_it_not_ignored(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"max_token": 5})
    assert info.value.param == "max_token" and "unknown field" in info.value.message


def test_out_of_range_values_are_refused_naming_the_request_field(client):
    cases = [({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"5": 200}}, "logit_bias"),
             ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"logprobs": 21}, "logprobs")]  # fmt: skip
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)
        assert info.value.param == param, (extra, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=30,
                                       logprobs=True)  # fmt: skip
    assert info.value.param == "top_logprobs"


# -- log-probabilities -----------------------------------------------------------------------------


def test_chat_logprobs_equal_the_models_log_softmax_whole_and_streamed(llm, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, seed=3,
                                           logprobs=True, top_logprobs=3, extra_body=NO_THINKING)  # fmt: skip
    entries = reply.choices[0].logprobs.content
    prompt = llm.tokenizer.chat_ids(messages, enable_thinking=False)
    generated = llm.generate([prompt], _params(max_tokens=8, temperature=0.9, seed=3))[0].outputs[0].token_ids
    expected = model_logprobs(llm, prompt + generated)[len(prompt) - 1 : -1]  # (8, V): each predicts the next
    assert len(entries) == len(generated) == 8
    for step, (entry, token) in enumerate(zip(entries, generated)):
        assert bytes(entry.bytes) == token_bytes(llm.tokenizer, token)
        assert entry.logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
        top = expected[step].topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        top_bytes = [token_bytes(llm.tokenizer, i) for i in top.indices.tolist()]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == top_bytes
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, seed=3,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body=NO_THINKING)  # fmt: skip
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completion_echo_scores_the_prompt_as_evaluation_harnesses_ask(llm, client):
    """lm-eval's local-completions loglikelihood request: token ids, echo, logprobs=1, then [ctx:-1]."""
    ids = llm.tokenizer.encode("The capital of France is Paris")
    expected = model_logprobs(llm, ids)
    for max_tokens in (1, 0):  # 0: OpenAI's "score the prompt only"
        reply = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                          temperature=0)  # fmt: skip
        lp = reply.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
            greedy = llm.tokenizer.decode([int(expected[i - 1].argmax())])
            assert max(lp.top_logprobs[i].values()) == pytest.approx(expected[i - 1].max().item(), abs=1e-4)
            assert greedy in lp.top_logprobs[i]
        assert reply.choices[0].text.startswith(llm.tokenizer.decode(ids))
    assert reply.usage.completion_tokens == 0


def test_streamed_echo_and_logprobs_add_up_to_the_whole_reply(client):
    args = dict(model=MODEL, prompt="Once upon a time", echo=True, logprobs=2, max_tokens=6, temperature=0)
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset


# -- more than one answer --------------------------------------------------------------------------


def _params(**kwargs):
    from qwen3_scratch.sampling.params import SamplingParams

    return SamplingParams(**kwargs)


def test_n_choices_each_with_its_index_seeded_as_seed_plus_index(llm, client):
    reply = client.completions.create(model=MODEL, prompt="Hello", n=3, max_tokens=6, temperature=1.0, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for c in reply.choices:
        alone = llm.generate("Hello", _params(max_tokens=6, temperature=1.0, seed=7 + c.index))[0].outputs[0]
        assert c.text == alone.text and c.finish_reason == alone.finish_reason
    assert len({c.text for c in reply.choices}) > 1, "three seeds, three different samples"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, temperature=1.0, seed=1, extra_body=NO_THINKING)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10


def test_the_n_choices_share_the_prompts_cached_blocks(llm):
    prompt = list(range(10, 10 + 70))  # 4 full blocks of 16 and a tail
    out = llm.generate([prompt], _params(n=4, max_tokens=3, temperature=1.0, seed=0))[0]
    assert len(out.outputs) == 4 and out.num_cached_tokens == 64, "siblings reuse the first choice's full blocks"


def test_a_list_of_prompts_and_token_id_prompts_give_n_choices_each_in_order(llm, client):
    ids = llm.tokenizer.encode("def add(a, b")
    reply = client.completions.create(model=MODEL, prompt=["Hello", "World"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for prompt, choice in zip(["Hello", "Hello", "World", "World"], reply.choices):
        assert choice.text == llm.generate(prompt, _params(max_tokens=4, temperature=0))[0].outputs[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == llm.generate([ids], _params(max_tokens=4, temperature=0))[0].outputs[0].text
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    stream = client.completions.create(model=MODEL, prompt=["Hello", "World"], max_tokens=4, temperature=0, stream=True)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: reply.choices[0].text, 1: reply.choices[2].text}, "greedy: each prompt's choices agree"


# -- logit processing ------------------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens(llm, client):
    free = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    first = llm.tokenizer.encode(free.choices[0].text)[0]
    banned = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                       logit_bias={str(first): -100}, logprobs=0)  # fmt: skip
    assert banned.choices[0].text != free.choices[0].text
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={"300": 100})  # fmt: skip
    assert forced.choices[0].text == llm.tokenizer.decode([300] * 5)


def test_penalties_through_the_server_equal_the_engine_and_the_simple_loop(llm, client):
    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.sampling.logits import LogitsFilter

    settings = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    reply = client.completions.create(model=MODEL, prompt="Hello hello", max_tokens=12, temperature=0,
                                      extra_body={"repetition_penalty": 1.3}, presence_penalty=1.5,
                                      frequency_penalty=0.5)  # fmt: skip
    ids = llm.tokenizer.encode("Hello hello")
    params = _params(max_tokens=12, temperature=0, **settings)
    loop = [int(t[0]) for t in generate_tokens(llm.model, [ids], 12, LogitsFilter(temperature=0.0), [],
                                               processing=params.processing())]  # fmt: skip
    assert reply.choices[0].text == llm.tokenizer.decode(loop, skip_special_tokens=True)
    plain = client.completions.create(model=MODEL, prompt="Hello hello", max_tokens=12, temperature=0)
    assert plain.choices[0].text != reply.choices[0].text, "the penalties changed the greedy text"


def test_min_tokens_holds_back_eos(llm, client):
    eos = llm.eos_ids[0]
    bias = {str(eos): 100}
    early = client.completions.create(model=MODEL, prompt="Hi", max_tokens=10, temperature=0, logit_bias=bias)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt="Hi", max_tokens=10, temperature=0, logit_bias=bias,
                                     extra_body={"min_tokens": 4})  # fmt: skip
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5


def test_min_tokens_holds_back_stop_strings_in_completions_whole_and_streamed(llm, client):
    """Greedy text repeats "Hello": "loHel" ends in the 2nd token; min_tokens=3 lets the first one ending after
    the 3rd token stop it (cut before its start, inside those tokens' text), as LLM.generate does."""
    for min_tokens, text in ((0, "Hel"), (3, "HelloHelloHel")):
        request = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=["loHel"],
                       extra_body={"min_tokens": min_tokens, "ignore_eos": True})  # fmt: skip
        reply = client.completions.create(**request)
        stream = "".join(c.choices[0].text for c in client.completions.create(**request, stream=True) if c.choices)
        params = _params(max_tokens=12, temperature=0, stop=["loHel"], min_tokens=min_tokens, ignore_eos=True)
        reference = llm.generate("Hello", params)[0].outputs[0]
        assert reply.choices[0].text == stream == reference.text == text, min_tokens
        assert reply.usage.completion_tokens == len(reference.token_ids) and reply.choices[0].finish_reason == "stop"


# -- structured output on random weights -----------------------------------------------------------
# A random model never ends its reasoning, so these ask with thinking off (NO_THINKING): with it on, the
# grammar starts only after </think> (the tests after these).


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    capital: bool


def test_parse_with_a_pydantic_model_returns_a_valid_instance_on_random_weights(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "A city, as JSON."}], response_format=City,
            max_tokens=80, temperature=1.0, seed=seed, extra_body=NO_THINKING)  # fmt: skip
        assert completion.choices[0].finish_reason == "stop", completion.choices[0].message.content
        assert isinstance(completion.choices[0].message.parsed, City)


def test_json_object_and_a_json_schema_stream_valid_json(llm, client):
    """A random model inside a JSON string never closes it (greedy loops on one token), so the json_object case
    pushes `"` and `}` up with logit_bias: the grammar still decides where each may go."""
    quote, close = llm.tokenizer.encode('"')[0], llm.tokenizer.encode("}")[0]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    cases = [({"type": "json_object"}, {str(quote): 50, str(close): 30}),
             ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, None)]  # fmt: skip
    for response_format, bias in cases:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                                response_format=response_format, max_tokens=60, temperature=0,
                                                logit_bias=bias, stream=True, extra_body=NO_THINKING)  # fmt: skip
        chunks = [c.choices[0] for c in stream if c.choices]
        text = "".join(c.delta.content or "" for c in chunks)
        assert chunks[-1].finish_reason == "stop", text
        value = json.loads(text)
        assert isinstance(value, dict)
        if response_format["type"] == "json_schema":
            assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] <= 9


# Bounded strings and numbers: the grammar keeps every prefix valid, but only the model decides to stop a
# string or a number, and a random model may never do so within max_tokens.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
          "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
          "required": ["a", "b"], "additionalProperties": False}}}]  # fmt: skip


def test_forced_tool_choice_makes_valid_calls_on_random_weights(client):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           extra_body=NO_THINKING)  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(arguments) == {"a", "b"}
    assert named.choices[0].finish_reason == "tool_calls"
    # sampled on random weights, a call may not close within max_tokens (get_weather allows more properties,
    # each a string only the model ends): over a few seeds, some calls finish, and every one that does is valid
    finished = 0
    for seed in (2, 3, 4, 5):
        required = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=120,
                                                  temperature=1.0, seed=seed, tool_choice="required",
                                                  extra_body=NO_THINKING)  # fmt: skip
        choice = required.choices[0]
        calls = choice.message.tool_calls or []
        assert calls or choice.finish_reason == "length", f"seed {seed}: no call, and not cut by max_tokens"
        assert all(c.function.name in ("get_weather", "add") for c in calls)
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
        finished += len(calls)
    assert finished > 0, "no seed's call closed within max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})  # fmt: skip
    assert info.value.param == "tool_choice"


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip


def valid_under_schema(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] <= 9


def test_with_thinking_on_the_reasoning_is_free_and_the_grammar_starts_after_the_end_tag(llm):
    """Engine level, greedy: the tokens before </think> are exactly the unconstrained ones, the budget forces
    </think>, and what follows it is valid under the schema."""
    from qwen3_scratch import StructuredOutputsParams

    end = llm.tokenizer.token_to_id("</think>")
    prompt = llm.tokenizer.chat_ids([{"role": "user", "content": "JSON please"}], enable_thinking=True)
    budget = 7
    free = llm.generate([prompt], _params(temperature=0, max_tokens=budget))[0].outputs[0].token_ids
    spec = StructuredOutputsParams(json=SCHEMA, reasoning_end_str="</think>", thinking_token_budget=budget)
    out = llm.generate([prompt], _params(temperature=0, max_tokens=80, structured_outputs=spec))[0].outputs[0]
    assert end not in free, "this test wants a model that does not end its reasoning by itself"
    assert out.token_ids[:budget] == free, "the reasoning under a grammar differs from the unconstrained one"
    assert out.token_ids[budget] == end, "the budget did not force </think>"
    answer = llm.tokenizer.decode(out.token_ids[budget + 1 :], skip_special_tokens=True)
    assert out.finish_reason == "stop" and valid_under_schema(answer), answer
    # LLM.chat (thinking on by default) reads it the same way: the free tokens are the reasoning
    reply = llm.chat([{"role": "user", "content": "JSON please"}], _params(temperature=0, max_tokens=80,
                     structured_outputs=spec))[0].outputs[0]  # fmt: skip
    assert reply.token_ids == out.token_ids and reply.message["content"] == answer, reply.message
    assert reply.message["reasoning_content"] == llm.tokenizer.decode(free, skip_special_tokens=True).strip("\n")
    plain = StructuredOutputsParams(json=SCHEMA)  # LLM.chat itself starts it after </think>, thinking on
    short = llm.chat([{"role": "user", "content": "JSON please"}], _params(temperature=0, max_tokens=budget,
                     structured_outputs=plain))[0].outputs[0]  # fmt: skip
    assert short.token_ids == free, "LLM.chat with thinking on constrained the reasoning"


def test_a_chat_with_thinking_on_reasons_freely_then_answers_under_the_grammar(llm, client):
    messages = [{"role": "user", "content": "JSON please"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    ask = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    free = client.chat.completions.create(**ask)
    constrained = client.chat.completions.create(**ask, response_format=schema_format)
    assert constrained.usage.prompt_tokens == free.usage.prompt_tokens, "the prompt was rendered with thinking on"
    # The random model never writes </think>: its 8 tokens are all free reasoning, the very text of the unconstrained
    # reply (under the grammar from the first token it would have had to start with "{").
    reasoning = constrained.choices[0].message.model_extra["reasoning_content"]
    assert reasoning == free.choices[0].message.content and not reasoning.startswith("{"), (reasoning, free)
    assert constrained.choices[0].message.content == "" and constrained.choices[0].finish_reason == "length"
    end_think = str(llm.tokenizer.token_to_id("</think>"))
    end = client.chat.completions.create(**{**ask, "max_tokens": 60}, response_format=schema_format,
                                         logit_bias={end_think: 100})  # ends the reasoning at once  # fmt: skip
    message = end.choices[0].message
    assert end.choices[0].finish_reason == "stop" and valid_under_schema(message.content), end
    assert message.model_extra["reasoning_content"] == "", "the reasoning it ended at once is there, empty"


def test_vllm_structured_outputs_choice_and_regex(client):
    choice = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=10, temperature=1.0, seed=4,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=MODEL, prompt="A code:", max_tokens=10, temperature=1.0, seed=4,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})  # fmt: skip
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "nonsense"}})  # fmt: skip
    assert "not a valid json" in info.value.message


def test_the_serving_guide_lists_every_field_of_the_table_and_the_embeddings_route_covers_the_sdk():
    from pathlib import Path

    from openai.types import embedding_create_params

    from qwen3_scratch.server.embeddings import EMBEDDINGS

    guide = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    missing = [name for name in {**CHAT, **CHAT_VLLM, **COMPLETIONS, **VLLM, **EMBEDDINGS} if f"`{name}`" not in guide]
    assert not missing, f"docs/serving.md does not list {missing}"
    assert sdk_fields(embedding_create_params.EmbeddingCreateParams) - set(EMBEDDINGS) == set()


def test_vllms_prompt_logprobs_come_back_and_refusals_hold_when_streaming(llm, client):
    ids = llm.tokenizer.encode("Hello there friend")
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 2})  # fmt: skip
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    expected = model_logprobs(llm, ids)
    assert scored[0] is None and len(scored) == len(ids)
    for i in range(1, len(ids)):
        assert scored[i][str(ids[i])]["logprob"] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
    for extra in ({"best_of": 3}, {"max_token": 3}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True, extra_body=extra)
        assert info.value.param == next(iter(extra))


def test_streamed_prompt_logprobs_come_in_each_choices_first_chunk_equal_to_the_whole_answers(llm, client):
    ids = llm.tokenizer.encode("Hello there friend")
    ask = dict(model=MODEL, prompt=ids, max_tokens=3, temperature=0, n=2, extra_body={"prompt_logprobs": 2})
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        carrying = [k for k, choice in enumerate(mine) if "prompt_logprobs" in (choice.model_extra or {})]
        assert carrying == [0], f"choice {index}: prompt_logprobs on chunks {carrying} of {len(mine)}, not the first"
        expected = whole.choices[index].model_extra["prompt_logprobs"]
        assert mine[0].model_extra["prompt_logprobs"] == expected, "the streamed values differ from the whole answer's"
    messages = [{"role": "user", "content": "Hello there"}]
    chat = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1})
    whole_chat = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(**chat, stream=True))
    carrying = [c for c in chunks if "prompt_logprobs" in (c.model_extra or {})]
    assert len(carrying) == 1, "one chat chunk carries the prompt's logprobs"
    assert carrying[0].model_extra["prompt_logprobs"] == whole_chat.model_extra["prompt_logprobs"]
    assert len(whole_chat.model_extra["prompt_logprobs"]) == len(llm.tokenizer.chat_ids(messages))



def test_llm_takes_structured_outputs_through_sampling_params(llm):
    from qwen3_scratch import StructuredOutputsParams

    spec = StructuredOutputsParams(choice=["red", "green", "blue"])
    outs = llm.generate(["Pick a colour:"] * 3, [_params(seed=s, temperature=1.0, max_tokens=8,
                                                        structured_outputs=spec) for s in range(3)])  # fmt: skip
    assert all(o.outputs[0].text in ("red", "green", "blue") and o.outputs[0].finish_reason == "stop" for o in outs)
