"""Logit processing (sampling/processors.py) against reference computations and transformers' own processors,
and the same rules on every path: the simple loop, Pipeline and the engine."""

import dataclasses

import pytest
import torch
import transformers.generation.logits_process as hf
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import LLM, GenerationError, Pipeline, SamplingParams, Tokenizer, load_model
from qwen3_scratch.sampling.processors import LogitsProcessing, process_logits, prompt_mask
from qwen3_scratch.text.stop import AnswerStop, TextState

V = 50


def rows(seed=0, B=3):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def outputs_of(B=3, N=6, seed=1):
    return torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(seed))


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    logits, prompt, out = rows(), outputs_of(N=5, seed=2), outputs_of()
    ours = process_logits(logits, out, LogitsProcessing(repetition_penalty=1.7), prompt_mask(prompt, V))
    theirs = hf.RepetitionPenaltyLogitsProcessor(1.7)(torch.cat([prompt, out], 1), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_frequency_and_presence_penalties_follow_openais_formula():
    logits, out = rows(), outputs_of()
    ours = process_logits(logits, out, LogitsProcessing(frequency_penalty=0.7, presence_penalty=1.1))
    expected = logits.clone()
    for b in range(3):
        for token in set(out[b].tolist()):
            count = out[b].tolist().count(token)
            expected[b, token] -= 0.7 * count + 1.1  # OpenAI: mu - c*alpha_frequency - (c > 0)*alpha_presence
    torch.testing.assert_close(ours, expected)


def test_logit_bias_adds_to_each_listed_token_as_transformers_sequence_bias():
    logits = rows()
    bias = {3: 5.0, 7: -100.0, 11: 0.5}
    ours = process_logits(logits, outputs_of(), LogitsProcessing(logit_bias=tuple(bias.items())))
    theirs = hf.SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})(outputs_of(), logits.clone())
    torch.testing.assert_close(ours, theirs)


def test_min_tokens_bans_the_stop_ids_until_reached_as_transformers():
    logits = rows()
    for generated in (2, 4):
        out = outputs_of(N=generated)
        ours = process_logits(logits, out, LogitsProcessing(min_tokens=4), stop_ids=[5, 9])
        prompt = outputs_of(N=3, seed=5)
        theirs = hf.MinNewTokensLengthLogitsProcessor(3, 4, [5, 9])(torch.cat([prompt, out], 1), logits.clone())
        torch.testing.assert_close(ours, theirs, msg=f"after {generated} tokens")


def test_bad_words_ban_a_words_last_token_after_its_first_ones_as_transformers():
    logits, out = rows(), outputs_of()
    out[0, -2:] = torch.tensor([4, 8])  # row 0 ends with the first two tokens of word (4, 8, 15)
    words = ((4, 8, 15), (16,), (23, 42))
    ours = process_logits(logits, out, LogitsProcessing(bad_words=words))
    theirs = hf.NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=None)(out, logits.clone())
    torch.testing.assert_close(ours, theirs)
    assert ours[0, 15] == float("-inf") and ours[1, 15] != float("-inf") and (ours[:, 16] == float("-inf")).all()


def test_the_chain_runs_in_vllms_order_bias_before_penalties():
    """A logit_bias'd token that was already generated is then penalised: bias first, then the division."""
    logits = torch.zeros(1, V)
    processing = LogitsProcessing(logit_bias=((3, 4.0),), repetition_penalty=2.0)
    out = process_logits(logits, torch.tensor([[3]]), processing)
    assert out[0, 3] == pytest.approx(2.0), "(0 + 4) / 2: bias, then repetition penalty"


def test_nothing_asked_changes_nothing():
    assert not LogitsProcessing().active and not SamplingParams().processing().active
    logits = rows()
    torch.testing.assert_close(process_logits(logits, outputs_of(), LogitsProcessing()), logits)


# -- one rule on every path --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("processing") / "tiny")


@pytest.fixture(scope="module")
def pipe(tiny):
    # the checkpoint's own layout: Pipeline.load would first compile the CPU decode kernels (~10 s), not under test here
    return Pipeline(load_model(tiny), Tokenizer.from_checkpoint(tiny), tiny)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), dtype="float32", num_blocks=64)


PROCESSED = dict(temperature=0, max_tokens=12, presence_penalty=1.2, frequency_penalty=0.4, repetition_penalty=1.5,
                 logit_bias={7: 3.0}, min_tokens=3, bad_words=["the"])  # fmt: skip


def test_pipeline_and_the_engine_apply_the_same_processing(pipe, llm):
    prompts = ["The quick brown fox", "Hello! How are you"]
    params = SamplingParams(**PROCESSED)
    engine = [out.outputs[0].text for out in llm.generate(prompts, params)]
    plain = pipe.generate(prompts, SamplingParams(temperature=0, max_tokens=12), chat=False)
    assert pipe.generate(prompts, params, chat=False) == engine
    assert engine != plain, "the processing changed the greedy text"
    assert all(" the" not in text and not text.startswith("the") for text in engine), engine


def test_chat_conversation_applies_processing_like_the_engine(pipe, llm):
    messages = [{"role": "user", "content": "Tell me a story."}]
    params = SamplingParams(**PROCESSED)
    reply = pipe.chat(messages, params, thinking=False)
    assert reply == llm.chat(messages, params, enable_thinking=False)[0].outputs[0].message


# -- min_tokens holds back stop strings too (vLLM v1: none may end in the first min_tokens tokens' text) --

LINES = "One\ntwo\nthree\nfour"  # the tiny tokenizer: one token per "\n", the 4th, 8th and 13th


def stopped_text(tokenizer, stop, min_tokens):
    """(text, tokens pushed) of LINES through TextState, ending at the first stop string that counts."""
    state = TextState(tokenizer, [stop], min_tokens=min_tokens)
    ids = tokenizer.encode(LINES)
    for n, token in enumerate(ids, 1):
        if state.push(token):
            return state.take(finished=True, stopped=True), n
    return state.take(finished=True, stopped=False), len(ids)


@pytest.mark.parametrize(("stop", "min_tokens", "text", "tokens"), [
    ("\n", 0, "One", 4),  # the first newline stops it
    ("\n", 3, "One", 4),  # the 4th token is past min_tokens
    ("\n", 4, "One\ntwo", 8),  # the newline in the first 4 tokens is ignored; the next one stops it
    ("e\nt", 4, "On", 5),  # starts in the first 4 tokens, ends in the 5th: it counts, cut before its start
    ("e\nt", 5, LINES, 16),  # wholly in the first 5 tokens: ignored (and "e\nf" is no stop string)
])  # fmt: skip
def test_min_tokens_ignores_stop_strings_ending_in_the_first_tokens_text(pipe, stop, min_tokens, text, tokens):
    assert stopped_text(pipe.tokenizer, stop, min_tokens) == (text, tokens)
    # the chat answer's cut follows the same rule, though the parser holds a trailing newline back a token
    reply = AnswerStop.reply(pipe.tokenizer, pipe.tokenizer.encode(LINES)[:tokens], False, [stop], min_tokens)
    assert reply["content"] == text


HELLO = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["loHel"])  # greedy: "HelloHello..."


def test_every_path_holds_a_stop_string_back_until_min_tokens(pipe, llm):
    """The tiny model repeats "Hello": "loHel" ends in the 2nd token; with min_tokens=3 the first one that ends
    after the 3rd token starts inside them, so the text is cut there, in every path."""
    held = dataclasses.replace(HELLO, min_tokens=3)
    ids = pipe.tokenizer.encode("Hello")
    for params, text, tokens in ((HELLO, "Hel", 2), (held, "HelloHelloHel", 4)):
        out = llm.generate([ids], params)[0].outputs[0]
        assert (out.text, len(out.token_ids), out.finish_reason) == (text, tokens, "stop"), params.min_tokens
        assert pipe.generate(["Hello"], params, chat=False) == [text]
        assert "".join(pipe.stream("Hello", params, chat=False)) == text and len(pipe.last_ids) == tokens


def test_chat_paths_hold_a_stop_string_back_until_min_tokens(pipe, llm):
    messages = [{"role": "user", "content": "Say hello."}]
    hello = pipe.tokenizer.encode("Hello")[0]
    forced = dataclasses.replace(HELLO, logit_bias={hello: 100.0})  # the answer: "HelloHello..."
    for params, text, tokens in ((forced, "Hel", 2), (dataclasses.replace(forced, min_tokens=3), "HelloHelloHel", 4)):
        out = llm.chat(messages, params, enable_thinking=False)[0].outputs[0]
        assert (out.message["content"], len(out.token_ids)) == (text, tokens), params.min_tokens
        assert pipe.chat(messages, params, thinking=False) == out.message
        assert len(pipe.conversation.last_ids) == tokens


def test_pipeline_refuses_what_only_the_engine_implements(pipe):
    for field, value in (("n", 2), ("logprobs", 1), ("prompt_logprobs", 0)):
        with pytest.raises(GenerationError, match=f"Pipeline does not implement {field}; use LLM"):
            pipe.generate(["hi"], SamplingParams(**{field: value}))


def test_llm_logprobs_and_prompt_logprobs_equal_the_models_log_softmax(llm):
    ids = llm.tokenizer.encode("The quick brown fox jumps")
    out = llm.generate([ids], SamplingParams(temperature=0.8, seed=0, max_tokens=5, logprobs=2, prompt_logprobs=1))[0]
    full = ids + out.outputs[0].token_ids
    expected = torch.log_softmax(llm.model(torch.tensor([full]))[0].float(), dim=-1)  # (T, V)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position in range(1, len(full)):
        scored = out.prompt_logprobs[position] if position < len(ids) else out.outputs[0].logprobs[position - len(ids)]
        token = full[position]
        assert scored[token].logprob == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        assert scored[token].rank == int((expected[position - 1] > expected[position - 1, token]).sum()) + 1
    total = sum(expected[i - 1, full[i]].item() for i in range(len(ids), len(full)))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_llm_n_choices_are_the_seeded_single_runs(llm):
    many = llm.generate("Once", SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=6))[0]
    singles = [llm.generate("Once", SamplingParams(seed=5 + i, temperature=1.0, max_tokens=6))[0] for i in range(3)]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert [c.token_ids for c in many.outputs] == [s.outputs[0].token_ids for s in singles]


def test_the_cli_flags_map_to_the_same_fields_and_errors_name_the_flag():
    from qwen3_scratch.cli.flags import params_from_args
    from qwen3_scratch.cli.generate import build_parser
    from qwen3_scratch.errors import Qwen3Error

    args = build_parser().parse_args(["--presence-penalty", "1", "--frequency-penalty", "0.5",
                                      "--repetition-penalty", "1.2", "--min-tokens", "3", "--bad-word", "x",
                                      "--logit-bias", "100=-100"])  # fmt: skip
    params = params_from_args(args)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_tokens,
            params.bad_words, params.logit_bias) == (1.0, 0.5, 1.2, 3, ["x"], {100: -100.0})  # fmt: skip
    cases = ((["--repetition-penalty", "0"], "--repetition-penalty"), (["--logit-bias", "7=300"], "--logit-bias"),
             (["--logit-bias", "seven"], "--logit-bias"))  # fmt: skip
    for flags, flag in cases:
        with pytest.raises(Qwen3Error, match=f"^{flag} must be"):
            params_from_args(build_parser().parse_args(flags))
