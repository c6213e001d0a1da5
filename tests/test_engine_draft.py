"""A draft model as the engine's proposer (engine/draft_proposer.py): for many sequences at once its proposals
give exactly the plain engine's tokens (greedy, fp32) or its distribution (sampling); the draft's own KV pool
stays right through rollbacks, preemption and the prefix cache (a target drafting for itself keeps every
proposal, which it can only do if the draft's keys are right); every block comes back; bad configs are
refused in one line from LLM and from qwen3-serve."""

import json
import shutil

import pytest
import torch
from checkpoints import build_checkpoint, one_thread_for_tiny_shapes
from make_tiny_checkpoint import make_tiny_checkpoint
from test_engine_speculative import random_ids, run
from test_speculative_sampling import assert_2nd_and_3rd_tokens_follow_the_model, tiny_model

from qwen3_scratch import Qwen3Error, load_model
from qwen3_scratch.cli.serve import main as serve_main
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

one_thread = pytest.fixture(scope="module", autouse=True)(one_thread_for_tiny_shapes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft-target") / "tiny")


@pytest.fixture(scope="module")
def small_draft(checkpoint, tmp_path_factory):
    """Another random model, smaller and shaped otherwise (1 layer, 1 kv head), with the target's tokenizer."""
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    folder = build_checkpoint(tmp_path_factory.mktemp("small-draft"), vocab_size=vocab_size, num_hidden_layers=1,
                              hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              max_position_embeddings=2048, initializer_range=0.2, seed=5)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_checkpoint(checkpoint)


def greedy(n, **kwargs):
    return SamplingParams(temperature=0, max_tokens=n, **kwargs)


REQUESTS = {
    "short": (random_ids(5, 1), greedy(30)),
    "long": (random_ids(41, 2), greedy(23)),
    "mid": (random_ids(17, 3), greedy(35)),
    "tiny-max": (random_ids(9, 4), greedy(2)),  # max_tokens cuts the first round (k clipped to 1)
    "odd": (random_ids(3, 5), greedy(17)),
}


def engine(model, tokenizer, draft=None, num_blocks=128, k=4, **kwargs):
    config = {"model": str(draft), "num_speculative_tokens": k} if draft is not None else None
    return LLMEngine(model, tokenizer, eos_ids=[], num_blocks=num_blocks, block_size=4, speculative_config=config,
                     **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def plain(model, tokenizer):
    return run(engine(model, tokenizer), REQUESTS)


def test_the_target_drafting_for_itself_gives_plain_tokens_and_keeps_every_proposal(model, tokenizer, checkpoint,
                                                                                    plain):  # fmt: skip
    spec_engine = engine(model, tokenizer, checkpoint)
    spec = run(spec_engine, REQUESTS)
    for request_id in REQUESTS:
        assert spec[request_id] == plain[request_id], f"{request_id}: speculation changed the output"
    s = spec_engine.speculator
    assert s.num_proposed > 60, f"only {s.num_proposed} tokens proposed: too few rounds for the test to mean much"
    assert s.num_accepted == s.num_proposed, f"a self-draft kept {s.num_accepted}/{s.num_proposed}: its keys are wrong"
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks, "blocks leaked after the run"


def test_a_different_small_draft_gives_plain_tokens_with_rejections(model, tokenizer, small_draft, plain):
    spec_engine = engine(model, tokenizer, small_draft, k=3)
    spec = run(spec_engine, REQUESTS)
    for request_id in REQUESTS:
        assert spec[request_id] == plain[request_id], f"{request_id}: speculation changed the output"
    s = spec_engine.speculator
    assert s.num_accepted < s.num_proposed / 2, f"kept {s.num_accepted}/{s.num_proposed}: this draft should mostly miss"
    assert s.num_emitted > s.num_accepted, "rejected rounds must still emit the target's own token"
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks, "blocks of rejected proposals leaked"


def test_a_draft_under_preemption_gives_plain_tokens(model, tokenizer, checkpoint, plain):
    """A pool too small for all at once: sequences are preempted, recomputed, and drafted for again."""
    spec_engine = engine(model, tokenizer, checkpoint, num_blocks=26)
    spec = run(spec_engine, REQUESTS)
    assert spec_engine.num_preemptions > 0, "the pool was large enough: preemption went untested"
    for request_id in REQUESTS:
        assert spec[request_id] == plain[request_id], f"{request_id}: preemption with a draft changed the output"
    s = spec_engine.speculator
    assert s.num_accepted == s.num_proposed, f"a self-draft kept {s.num_accepted}/{s.num_proposed} after recomputes"
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks


def test_prefix_cache_hits_hold_the_drafts_keys_too(model, tokenizer, checkpoint):
    """The second request's prompt is the first's prompt and answer: its cached blocks were written by
    speculative rounds; a self-draft keeps every proposal after the hit only if the draft's keys are there."""
    prompt = random_ids(13, 9)
    spec_engine = engine(model, tokenizer, checkpoint)
    first = run(spec_engine, {"first": (prompt, greedy(30))})["first"][0]
    proposed_before = spec_engine.speculator.num_proposed
    longer = prompt + first
    again = run(spec_engine, {"longer": (longer, greedy(20))})["longer"]
    assert spec_engine.blocks.hit_tokens >= len(longer) - 4 - 3, "the answer's blocks were not reused"
    assert again == run(engine(model, tokenizer), {"longer": (longer, greedy(20))})["longer"]
    s = spec_engine.speculator
    assert s.num_proposed > proposed_before, "the second request never speculated"
    assert s.num_accepted == s.num_proposed, f"kept {s.num_accepted}/{s.num_proposed}: cache misses draft keys"
    assert spec_engine.blocks.num_free == spec_engine.blocks.num_blocks


def test_sampled_tokens_with_a_draft_are_distributed_as_without_speculation():
    """The 2nd and 3rd sampled tokens (from the first speculative round: k = 2 proposals drawn from another
    model's distribution) against their exact distributions under the target alone."""
    target, draft = tiny_model(3), tiny_model(4)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 1, 2]
    spec_engine = LLMEngine(target, None, eos_ids=[], num_blocks=1024, block_size=4, max_num_seqs=256,
                            speculative_config={"method": "draft_model", "model": "in memory",
                                                "num_speculative_tokens": 2}, draft_model=draft)  # fmt: skip
    n = 3000
    out = run(spec_engine, {str(seed): (prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=seed))
                            for seed in range(n)})  # fmt: skip
    assert_2nd_and_3rd_tokens_follow_the_model(target, prompt, [tokens for tokens, _, _ in out.values()],
                                                spec_engine.speculator)  # fmt: skip


def other_tokenizer(small_draft, folder):
    other = shutil.copytree(small_draft, folder)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][-1], "id": 1100, "content": "<extra>"})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    return other


def wider_vocab(small_draft, folder):
    wider = shutil.copytree(small_draft, folder)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    return wider


BAD = [
    ({"method": "draft_model"}, "speculative_config.model must name"),
    ({"method": "ngram", "model": "x"}, "speculative_config.model is for method"),
    ({"model": "x", "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max is for method \"ngram\""),
    ({"model": "x", "num_speculative_tokens": 16}, "speculative_config.num_speculative_tokens"),
    ({"model": "x", "draft_tensor_parallel_size": 2}, "speculative_config.draft_tensor_parallel_size is not a known"),
    ({"model": "{tmp}/nowhere"}, "speculative_config.model: the draft"),
    ({"model": "{other}"}, "tokenizer.json"),
    ({"model": "{wider}"}, "config.json says vocab_size="),
]


@pytest.fixture(scope="module")
def bad_folders(small_draft, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-drafts")
    return {"tmp": tmp, "other": other_tokenizer(small_draft, tmp / "other"),
            "wider": wider_vocab(small_draft, tmp / "wider")}


@pytest.mark.parametrize("config, needle", BAD)
def test_llm_refuses_a_bad_draft_config_in_one_line(checkpoint, bad_folders, config, needle):
    config = {name: value.format(**bad_folders) if isinstance(value, str) else value for name, value in config.items()}
    with pytest.raises(Qwen3Error) as refused:
        LLM(str(checkpoint), dtype="float32", num_blocks=16, local_files_only=True, speculative_config=config)
    assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_a_draft_with_another_logit_width_is_refused(model, tokenizer):
    with pytest.raises(Qwen3Error, match="speculative_config.model: the draft has vocab_size=8"):
        LLMEngine(model, tokenizer, eos_ids=[], num_blocks=8, speculative_config={"model": "m"},
                  draft_model=tiny_model(0))


@pytest.mark.parametrize("config, needle", [BAD[0], BAD[3], BAD[6]])
def test_serve_refuses_a_bad_draft_config_with_one_line_and_exit_2(checkpoint, bad_folders, capsys, config, needle):
    config = {name: value.format(**bad_folders) if isinstance(value, str) else value for name, value in config.items()}
    status = serve_main(["--model", str(checkpoint), "--dtype", "float32", "--num-blocks", "16",
                         "--speculative-config", json.dumps(config)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and needle in err[0], err


def test_llm_with_a_draft_generates_the_plain_llms_text(checkpoint, small_draft):
    prompts = ["Hello there", "def greet(name):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = []
    for config in (None, {"model": str(small_draft), "num_speculative_tokens": 3}):
        llm = LLM(str(checkpoint), dtype="float32", num_blocks=64, local_files_only=True, speculative_config=config)
        texts.append([out.outputs[0].text for out in llm.generate(prompts, params)])
    assert texts[1] == texts[0], "the LLM with a draft answered otherwise"
    assert llm.engine.speculator.method == "draft_model" and llm.engine.speculator.num_proposed > 0


def test_the_server_with_a_draft_answers_as_the_plain_one_and_counts_on_metrics(checkpoint, small_draft):
    import httpx
    import openai
    from openai_server import serving
    from test_engine_speculative import spec_counts

    ask = dict(model="tiny", messages=[{"role": "user", "content": "Hello there, how are you?"}], temperature=0,
               max_tokens=30, extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    answers = []
    for config in (None, {"model": str(small_draft), "num_speculative_tokens": 3}):
        llm = LLM(str(checkpoint), num_blocks=64, dtype="float32", local_files_only=True, speculative_config=config)
        with serving(llm, "tiny") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            answers.append(client.chat.completions.create(**ask).choices[0].message.content)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                               if c.choices)  # fmt: skip
            assert streamed == answers[-1], "the streamed answer differs from the whole one"
            metrics = httpx.get(f"{url}/metrics").text
    assert answers[1] == answers[0], "the draft changed the server's greedy answer"
    counts = spec_counts(metrics, "draft_model")
    assert counts["proposed"] > 0 and 0 <= counts["accepted"] <= counts["proposed"], counts
    assert counts["emitted"] > counts["accepted"], counts
