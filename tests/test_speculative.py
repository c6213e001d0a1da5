"""Speculative decoding changes the speed, never the output.

Greedy: in fp32, speculation gives plain greedy decoding's tokens exactly, for both proposers (prompt
lookup; a draft model that is a different random checkpoint, or the target itself), also where EOS, a
stop token, a stop string, max_tokens or the context end falls inside a round of kept proposals, and
in a chat whose cache is rolled back between rounds and reused across turns. Sampling: the tokens
are drawn from the target's distribution (a chi-square test, in test_speculative_sampling.py).

The target is a random fp32 model written by transformers (tests/checkpoints.py) with the tiny BPE
tokenizer, as in test_conversation.py, initialised 5x wider than transformers' default so that its
greedy text varies (at the default it repeats one token, and every proposal would be kept). The draft
is another checkpoint: the target's weights plus 3% noise, so it agrees with the target about half
the time and rounds both keep and reject proposals. Random models also repeat themselves, which gives
prompt lookup proposals to keep. Tests assert that proposals were kept where their point needs it.
"""

import io
import json
import re
import shutil

import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint
from cli_helpers import assert_one_line_error, cli
from make_tiny_checkpoint import CHAT_TEMPLATE_FILE, tokenizer_config, train_tiny_tokenizer, write_json
from safetensors.torch import load_file, save_file

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.cli.chat import ChatSession
from qwen3_scratch.cli.chat import build_parser as build_chat_parser
from qwen3_scratch.cli.flags import speculative_args
from qwen3_scratch.errors import CheckpointError, GenerationError
from qwen3_scratch.generation.conversation import ConversationCache
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.sampling.prompt_lookup import PromptLookup
from qwen3_scratch.generation.speculative import AdaptiveK
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

PROMPTS = ["Hello there, how are you?", "def greet(name):", "人工智能正在改变世界。"]


def with_tokenizer(path, tokenizer):
    tokenizer.save(str(path / "tokenizer.json"))
    write_json(path / "tokenizer_config.json", tokenizer_config(tokenizer, CHAT_TEMPLATE_FILE.read_text()))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The target checkpoint and a draft (the target's weights, each plus 3% noise), sharing the tiny tokenizer."""
    tokenizer = train_tiny_tokenizer()
    target = build_checkpoint(
        tmp_path_factory.mktemp("target"), initializer_range=0.1,
        vocab_size=-(-tokenizer.get_vocab_size(with_added_tokens=True) // 64) * 64,
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"), eos_token_id=tokenizer.token_to_id("<|im_end|>"),
    )  # fmt: skip
    draft = shutil.copytree(target, tmp_path_factory.mktemp("draft") / "draft")
    generator = torch.Generator().manual_seed(1)
    weights = {name: w + 0.03 * w.std() * torch.randn(w.shape, generator=generator)
               for name, w in load_file(target / "model.safetensors").items()}  # fmt: skip
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    return with_tokenizer(target, tokenizer), with_tokenizer(draft, tokenizer)


@pytest.fixture(scope="module")
def models(folders):
    return load_model(folders[0]), load_model(folders[1])


def pipeline(folders, models, speculative=None, draft="other", k=None, adaptive=True):
    """A Pipeline over the loaded models; draft="self" drafts with the target itself."""
    target, other = models
    draft_model = {"other": other, "self": target}[draft] if speculative == "draft" else None
    pipe = Pipeline(target, Tokenizer.from_checkpoint(folders[0]), folders[0], speculative=speculative,
                    draft=draft_model, num_speculative_tokens=k)  # fmt: skip
    if pipe.speculator is not None:
        # off: every round proposes k (a self-draft never pays, so adaptive k would fall to 0)
        pipe.speculator.adaptive = adaptive
    return pipe


def token_ids(pipe, prompt_ids, params) -> list[int]:
    return [token for (token,) in pipe.stream_ids([prompt_ids], params)]


# proposer, draft, adaptive: prompt lookup as it runs by default; the noisy copy (some kept, some not)
# and the target itself (everything kept: rounds of 5 tokens), with every round at k=4
SPECULATORS = [("ngram", None, True), ("draft", "other", False), ("draft", "self", False)]


@pytest.mark.parametrize("speculative,draft,adaptive", SPECULATORS)
def test_greedy_speculation_gives_plain_greedy_tokens(folders, models, speculative, draft, adaptive):
    plain = pipeline(folders, models)
    spec = pipeline(folders, models, speculative, draft, k=4, adaptive=adaptive)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kept = 0
    for text in PROMPTS:
        ids = plain.prompt_ids(text)
        assert token_ids(spec, ids, params) == token_ids(plain, ids, params), f"{speculative}/{draft}: {text!r}"
        kept += spec.last_stats.speculation.accepted
    assert kept > 0, "no proposal was kept: the multi-token path was never exercised"
    if draft == "self":
        assert spec.last_stats.speculation.acceptance_rate == 1.0, "the target drafting for itself must always agree"


def test_penalties_decode_one_token_a_step_and_give_the_plain_tokens(folders, models):
    """Penalties read every earlier token, which a round's proposals would skip: such a request runs plain."""
    plain = pipeline(folders, models)
    spec = pipeline(folders, models, "draft", "self", k=4, adaptive=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.5, presence_penalty=1.0)
    ids = plain.prompt_ids(PROMPTS[0])
    penalised = token_ids(plain, ids, params)
    assert penalised != token_ids(plain, ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert token_ids(spec, ids, params) == penalised


def test_the_stats_line_reports_acceptance_and_tokens_per_forward(folders, models):
    spec = pipeline(folders, models, "draft", "self", k=4, adaptive=False)
    spec.generate([PROMPTS[0]], SamplingParams(max_tokens=21, temperature=0, ignore_eos=True))
    line = spec.last_stats.line()
    # 21 tokens: 1 from the prefill, then 4 rounds of 4 kept proposals + 1 of the target's own
    assert "accepted_tokens=16 acceptance_rate=1.000 tokens_per_forward=5.00" in line, line
    assert spec.last_stats.decode_steps == 4, "a decode step is one target forward"


def test_a_stop_token_inside_a_round_ends_the_output_where_plain_decoding_does(folders, models):
    plain = pipeline(folders, models)
    spec = pipeline(folders, models, "draft", "self", k=4, adaptive=False)  # rounds of 5 tokens after the first
    ids = plain.prompt_ids(PROMPTS[1])
    free = token_ids(plain, ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    # the first token that first appears at index >= 7: inside the second round (tokens 6..10)
    index = next(i for i, t in enumerate(free) if i >= 7 and t not in free[:i])
    params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[free[index]], ignore_eos=True)
    expected = free[: index + 1]
    assert token_ids(plain, ids, params) == expected
    assert token_ids(spec, ids, params) == expected, "speculation must end at the stop token, inside its round"
    assert index % 5 != 0, "the stop token must fall inside a round, not at its end"


def test_eos_stop_strings_and_max_tokens_inside_a_round_end_where_plain_decoding_does(folders, models):
    plain = pipeline(folders, models)
    spec = pipeline(folders, models, "draft", "self", k=4, adaptive=False)
    ids = plain.prompt_ids(PROMPTS[0])
    free = token_ids(plain, ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    # EOS: make the 9th token the checkpoint's EOS by asking for it as the pipeline's EOS id
    eos = free[8]
    for pipe in (plain, spec):
        pipe.generation_config = {**pipe.generation_config, "eos_token_id": [eos]}
    eos_params = SamplingParams(max_tokens=30, temperature=0)
    assert token_ids(spec, ids, eos_params) == token_ids(plain, ids, eos_params) == free[: free.index(eos) + 1]
    # max_tokens = 8: the second round (tokens 6..10) is cut after its second token
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert token_ids(spec, ids, short) == free[:8]
    # a stop string: the text of tokens 12 and 13
    stop = plain.tokenizer.decode(free[12:14])
    text = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert stop and spec.generate([PROMPTS[0]], text) == plain.generate([PROMPTS[0]], text)


def test_the_context_limit_ends_speculation_where_plain_decoding_ends(folders, models):
    plain = pipeline(folders, models)
    spec = pipeline(folders, models, "draft", "self", k=4, adaptive=False)
    context = plain.model.config.max_position_embeddings  # 256
    ids = torch.randint(3, 400, (context - 13,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, ignore_eos=True)  # no max_tokens: until the context is full
    expected = token_ids(plain, ids, params)
    assert len(expected) == 13 and plain.last_stop_reason == "context"
    assert token_ids(spec, ids, params) == expected and spec.last_stop_reason == "context"


@pytest.mark.parametrize("speculative,draft,adaptive", SPECULATORS[:2])
def test_chat_turns_with_speculation_give_plain_replies_and_a_consistent_cache(folders, models, speculative, draft,
                                                                                adaptive):  # fmt: skip
    plain = pipeline(folders, models)
    spec = pipeline(folders, models, speculative, draft, k=4, adaptive=adaptive)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    for turn in range(2):
        expected, reply = plain.chat(messages, params), spec.chat(messages, params)
        assert reply == expected, f"turn {turn + 1}"
        assert spec.conversation.last_stats.reused_tokens == plain.conversation.last_stats.reused_tokens
        messages += [reply, {"role": "user", "content": "And then?"}]
    # The cache holds exactly the keys/values of its tokens, as computed afresh: no rejected proposal leaked.
    cache = spec.conversation.cache
    probe = cache.tokens + [7]
    assert_logits_match(cache.prefill(probe), ConversationCache(spec.model).prefill(probe), "after speculative turns")


def test_pipeline_load_speculates_in_the_decode_layout(folders, models):
    """Pipeline.load lays the model out for decode (compiled one-row products, F.linear for a few rows)."""
    plain = pipeline(folders, models)
    spec = Pipeline.load(str(folders[0]), dtype="float32", speculative="ngram", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ids = plain.prompt_ids(PROMPTS[2])
    assert token_ids(spec, ids, params) == token_ids(plain, ids, params)


def test_a_draft_with_another_vocabulary_is_refused_naming_both_files(folders, tmp_path):
    target, draft = folders
    other = shutil.copytree(draft, tmp_path / "other-tokenizer")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][-1], "id": 1100, "content": "<extra>"})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match=r"other-tokenizer/tokenizer\.json.*target\d*/tokenizer\.json"):
        Pipeline.load(str(target), speculative="draft", draft_model=str(other))
    wider = shutil.copytree(draft, tmp_path / "wider")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(CheckpointError, match=r"wider/config\.json says vocab_size=\d+ but .*target\d*/config\.json"):
        Pipeline.load(str(target), speculative="draft", draft_model=str(wider))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(speculative="draft"), "--speculative draft needs --draft-model"),
    (dict(draft_model="x"), "--draft-model needs --speculative"),
    (dict(speculative="ngram", num_speculative_tokens=16), "--num-speculative-tokens must be an integer from 1 to 15"),
    (dict(speculative="medusa"), "--speculative must be one of ngram, draft"),
    (dict(speculative="ngram", use_cache=False), "drop --no-kv-cache"),
])  # fmt: skip
def test_impossible_speculation_settings_are_refused_before_loading(kwargs, needle, tmp_path):
    with pytest.raises(GenerationError, match=needle):
        Pipeline.load(str(tmp_path / "never-read"), **kwargs)


def test_several_prompts_at_once_are_refused_with_speculation(folders, models):
    spec = pipeline(folders, models, "ngram")
    with pytest.raises(GenerationError, match="one prompt at a time.*--batch-size 1"):
        spec.generate(PROMPTS[:2], SamplingParams(max_tokens=4))
    assert len(spec.generate(PROMPTS[:2], SamplingParams(max_tokens=4), batch_size=1)) == 2


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == ([4, 5, 1], None), "the latest '1 2' is at 4..5"
    lookup.start([])
    assert lookup.propose([7, 8, 9, 7, 8], 5) == ([9, 7, 8, 9, 7], None), "continued periodically past the end"
    lookup.start([])
    assert lookup.propose([1, 2, 3], 4) == ([], None), "no earlier occurrence: nothing to propose"
    longest = PromptLookup(max_ngram=2, min_ngram=2)
    assert longest.propose([5, 1, 6, 2, 1], 2) == ([], None), "a one-token match is below min_ngram"


def test_adaptive_k_falls_back_to_plain_steps_and_probes_when_nothing_is_kept():
    policy = AdaptiveK(max_k=4, proposal_cost=0.08)
    assert policy.choose() >= 1, "with the prior it speculates"
    ks = []
    for _ in range(900):
        ks.append(k := policy.choose())
        policy.update(k, 0)
    assert ks.index(0) < 24, f"nothing kept: plain steps within a few rounds, {ks[:24]}"
    probes = [i for i, k in enumerate(ks) if i > ks.index(0) and k]
    gaps = [b - a - 1 for a, b in zip([ks.index(0) - 1] + probes, probes)]
    assert gaps[:8] == [4, 8, 16, 32, 64, 128, 256, 256], f"each failed probe doubles the plain steps to the next: {gaps}"
    assert {ks[i] for i in probes} == {policy.probe_k}
    assert AdaptiveK(max_k=4, proposal_cost=0.0).probe_k == 4, "prompt lookup on a bf16 CPU: 5 rows cost what 2 do"
    assert AdaptiveK(max_k=4, proposal_cost=0.0, products="other").probe_k < 4, "where each row costs, a smaller probe"
    policy.update(1, 1)
    assert policy.probe_gap == AdaptiveK.PROBE_EVERY, "a kept token brings the probes back to every 4 steps"
    for _ in range(20):
        policy.update(4, 4)
    assert policy.choose() == 4, "all kept again: back to the most tokens a round"


def test_generate_cli_speculates_with_the_same_text_and_reports_it(folders, capsys):
    common = ["--model", folders[0], "--dtype", "float32", "--prompt", PROMPTS[1], "--temperature", "0",
              "--max-new-tokens", "24", "--ignore-eos", "--show-stats"]  # fmt: skip
    code, plain_out, _ = cli(capsys, *common)
    assert code == 0
    code, out, err = cli(capsys, *common, "--speculative", "draft", "--draft-model", folders[1],
                         "--num-speculative-tokens", "3")  # fmt: skip
    assert code == 0 and out == plain_out
    assert re.search(r"accepted_tokens=\d+ acceptance_rate=[\d.]+ tokens_per_forward=[\d.]+", err), err


@pytest.mark.parametrize("flags,needle", [
    (["--speculative", "draft"], "--speculative draft needs --draft-model"),
    (["--draft-model", "weights/x"], "--draft-model needs --speculative"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be an integer from 1"),
    (["--speculative", "ngram", "--prompt", "b", "--batch-size", "2"], "--speculative runs one prompt at a time"),
])  # fmt: skip
def test_generate_cli_refuses_impossible_speculation_in_one_line(folders, capsys, flags, needle):
    code, _, err = cli(capsys, "--model", folders[0], "--prompt", "a", *flags)
    assert_one_line_error(code, err, needle)


def test_chat_command_speculates_and_shows_acceptance_in_stats(folders):
    """qwen3-chat's flags -> Pipeline.load -> the session the command runs, in-process."""
    outputs = []
    for flags in ([], ["--speculative", "ngram"]):
        args = build_chat_parser().parse_args(["--model", str(folders[0]), "--dtype", "float32", *flags])
        pipe = Pipeline.load(args.model, dtype=args.dtype, **speculative_args(args))
        out, params = io.StringIO(), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        session = ChatSession(pipe, params, thinking=False, out=out)
        for line in ("Hello there", "And then?", "/stats"):
            session.handle(line)
        outputs.append(out.getvalue().splitlines())
    plain, spec = outputs
    assert len(plain) > 1 and spec[:-1] == plain[:-1], "the same two answers"
    assert "accepted_tokens=" in spec[-1] and "tokens_per_forward=" in spec[-1], spec[-1]
