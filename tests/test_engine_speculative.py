"""Speculative decoding in the engine (engine/speculative.py): prompt lookup's proposals checked for many
sequences in one step give exactly the plain engine's tokens (greedy) or its distribution (sampling),
keep the prefix cache right, and give every block back; the server takes --speculative-config and counts
what speculation did on /metrics."""

import openai
import pytest
import torch
from checkpoints import one_thread_for_tiny_shapes
from make_tiny_checkpoint import make_tiny_checkpoint
from openai_server import serving
from test_speculative_sampling import assert_2nd_and_3rd_tokens_follow_the_model, tiny_model

from qwen3_scratch import GenerationError, load_model
from qwen3_scratch.cli.serve import main as serve_main
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "tiny")


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_checkpoint(checkpoint)


def random_ids(length, seed):
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, requests):
    """requests: {id: (ids, params)} -> {id: (token ids, text, finish reason)}."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    out = {request_id: ([], "", None) for request_id in requests}
    while engine.has_unfinished():
        for step in engine.step():
            assert step.error is None, f"request {step.request_id} failed: {step.error!r}"
            ids, text, _ = out[step.request_id]
            out[step.request_id] = (ids + step.new_token_ids, text + step.new_text, step.finish_reason)
    return out


def engines(model, tokenizer, **kwargs):
    plain = LLMEngine(model, tokenizer, eos_ids=[], num_blocks=128, block_size=4, **kwargs)
    spec = LLMEngine(model, tokenizer, eos_ids=[], num_blocks=128, block_size=4, speculative_config=NGRAM, **kwargs)
    return plain, spec


def test_greedy_speculative_engine_equals_the_plain_engine_token_for_token(model, tokenizer):
    greedy = lambda n, **kw: SamplingParams(temperature=0, max_tokens=n, **kw)  # noqa: E731
    shared = random_ids(20, 7)
    requests = {
        "short": (random_ids(5, 1), greedy(40)),
        "long": (random_ids(37, 2), greedy(33)),
        "repeats": ([5, 6, 7, 8, 9] * 6, greedy(40)),
        "quote": (random_ids(12, 3) * 3, greedy(25)),
        "shared-a": (shared + random_ids(3, 4), greedy(30)),
        "shared-b": (shared + random_ids(6, 5), greedy(30)),
        "tiny-max": ([5, 6, 7, 8, 9] * 4, greedy(2)),  # max_tokens cuts the first speculative run
    }
    plain_engine, spec_engine = engines(model, tokenizer)
    plain = run(plain_engine, requests)
    # stop conditions inside accepted runs: a stop id and a stop string taken from the plain outputs' middles
    ids = plain["repeats"][0]
    requests["stop-id"] = (requests["repeats"][0], greedy(40, stop_token_ids=[ids[9]]))
    text = plain["quote"][1]
    requests["stop-str"] = (requests["quote"][0], greedy(25, stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
    plain = run(LLMEngine(model, tokenizer, eos_ids=[], num_blocks=128, block_size=4), requests)
    spec = run(spec_engine, requests)
    for request_id in requests:
        assert spec[request_id] == plain[request_id], f"{request_id}: speculation changed the output"
    assert plain["stop-id"][2] == "stop" and len(plain["stop-id"][0]) < 40, "the stop id must end a run early"
    speculator = spec_engine.speculator
    assert speculator.num_accepted > 20, f"too few proposals kept ({speculator.num_accepted}) for the test to mean much"
    assert speculator.num_accepted < speculator.num_proposed, "no proposal was rejected: rollback went untested"
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks, "blocks leaked after the run"


def test_blocks_sealed_by_a_speculative_run_hold_the_kept_tokens_keys(model, tokenizer):
    """After a speculative run, its prompt and its output's full blocks are in the prefix cache; a request
    reusing them (the same prompt, and the whole first answer as a prompt) gets the plain engine's tokens."""
    params = SamplingParams(temperature=0, max_tokens=30)
    prompt = random_ids(9, 11) * 3
    plain_engine, spec_engine = engines(model, tokenizer)
    first = run(spec_engine, {"first": (prompt, params)})["first"][0]
    longer = prompt + first
    again = run(spec_engine, {"again": (prompt, params), "longer": (longer, params)})
    assert spec_engine.speculator.num_accepted < spec_engine.speculator.num_proposed, "no rejection to roll back"
    assert spec_engine.blocks.hit_tokens >= len(prompt) - 4 + len(longer) - 4 - 3, "the cache was not reused"
    reference = run(plain_engine, {"again": (prompt, params), "longer": (longer, params)})
    assert again["again"][0] == first, "the same prompt from the cache gave other tokens"
    assert again["longer"][0] == reference["longer"][0], "cached output blocks hold keys of rejected proposals"
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks


def test_sampled_tokens_are_distributed_as_without_speculation():
    """The 2nd and 3rd sampled tokens (both from speculative rows: every token of the prompt recurs, so
    lookup always proposes) against their exact distributions, summed over the earlier tokens by the model."""
    model = tiny_model(3)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 1, 2]
    engine = LLMEngine(model, None, eos_ids=[], num_blocks=512, block_size=4, max_num_seqs=256,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
    n = 3000
    for seed in range(n):
        engine.add_request(str(seed), prompt, SamplingParams(temperature=1.0, max_tokens=3, seed=seed))
    out = {str(seed): [] for seed in range(n)}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id] += step.new_token_ids
    assert_2nd_and_3rd_tokens_follow_the_model(model, prompt, out.values(), engine.speculator)


@pytest.mark.parametrize("config, field", [
    ('{"method": "eagle"}', "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_max": "3"}, "speculative_config.prompt_lookup_max"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"draft_tokens": 3}, "speculative_config.draft_tokens"),
    ("{not json", "speculative_config is not valid JSON"),
])  # fmt: skip
def test_a_bad_speculative_config_is_refused_naming_the_field(model, config, field):
    with pytest.raises(GenerationError) as refused:
        LLMEngine(model, None, eos_ids=[], num_blocks=8, speculative_config=config)
    assert field in str(refused.value) and "\n" not in str(refused.value)


def test_serve_refuses_a_bad_speculative_config_in_one_line(capsys):
    status = serve_main(["--model", "nowhere", "--speculative-config", '{"num_speculative_tokens": 99}'])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and "speculative_config.num_speculative_tokens" in err, err


def test_the_speculating_server_answers_as_the_plain_one_and_counts_on_metrics(checkpoint):
    import httpx

    messages = [{"role": "user", "content": "abc abc abc abc abc abc abc abc abc"}]
    ask = dict(model="tiny", messages=messages, temperature=0, max_tokens=40,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    answers = []
    for config in (None, NGRAM):
        with serving(LLM(str(checkpoint), num_blocks=64, dtype="float32", speculative_config=config), "tiny") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            answers.append(client.chat.completions.create(**ask).choices[0].message.content)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                               if c.choices)  # fmt: skip
            assert streamed == answers[-1], "the streamed answer differs from the whole one"
            metrics = httpx.get(f"{url}/metrics").text
    assert answers[1] == answers[0], "speculation changed the server's greedy answer"
    counts = spec_counts(metrics, "ngram")
    assert counts["proposed"] > 0, metrics
    assert 0 < counts["accepted"] <= counts["proposed"], counts
    assert counts["emitted"] > counts["accepted"], counts


def spec_counts(metrics: str, method: str) -> dict[str, float]:
    """/metrics' speculation counters for `method`: {"proposed": ..., "accepted": ..., "emitted": ...}."""
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("qwen3_spec_"))
    return {what: float(samples[f'qwen3_spec_{what}_tokens_total{{method="{method}"}}'])
            for what in ("proposed", "accepted", "emitted")}  # fmt: skip
