"""Multi-turn chat: the cache kept across turns gives the logits and greedy tokens of starting afresh.

The checkpoint is built by transformers (random fp32 weights, tests/checkpoints.py) and given the tiny
checkpoint's tokenizer and Qwen3-style template, so one folder serves both models: our Pipeline renders
and tokenizes each turn, and transformers generates from exactly those prompt ids. The oracle is thus
compared at the ids level, which is where the question is (does reusing the cache change what the model
computes?); that our ids equal transformers' own template ids is the tokenizer tests' job.
"""

import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint, load_reference
from make_tiny_checkpoint import CHAT_TEMPLATE_FILE, tokenizer_config, train_tiny_tokenizer, write_json

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.conversation import ConversationCache, common_prefix_length
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = train_tiny_tokenizer()
    vocab = -(-tokenizer.get_vocab_size(with_added_tokens=True) // 64) * 64
    path = build_checkpoint(
        tmp_path_factory.mktemp("conversation"), vocab_size=vocab, max_position_embeddings=512,
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"), eos_token_id=tokenizer.token_to_id("<|im_end|>"),
    )  # fmt: skip
    tokenizer.save(str(path / "tokenizer.json"))
    write_json(path / "tokenizer_config.json", tokenizer_config(tokenizer, CHAT_TEMPLATE_FILE.read_text()))
    return path


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return Pipeline(load_model(checkpoint), Tokenizer.from_checkpoint(checkpoint), checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def user(text):
    return {"role": "user", "content": text}


def fresh_logits(model, prompt):
    return ConversationCache(model).prefill(prompt)  # (1, V)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([], [1]) == 0 and common_prefix_length([5, 6], [5, 6, 7]) == 2


def test_logits_after_reuse_equal_a_fresh_prefill_and_transformers(pipe, reference):
    """Turn 1 fills a cache (prompt + generated tokens), turn 2 reuses it, growing it past its first block.

    Not bit-exact by design of BLAS, so the suite's fp32 bar (1e-5 x the largest logit): the reused path
    runs the suffix as a (T_new, C) matmul against cached keys, the fresh one all T rows at once, and a
    matmul's summation order depends on its shape.
    """
    tok = pipe.tokenizer
    messages = [user("Hello there, how are you?")]
    cache = ConversationCache(pipe.model, block=16)  # small blocks: turn 2 must grow (copy) the cache
    logits = cache.prefill(tok.chat_ids(messages), reserve=8)
    for _ in range(8):
        logits = cache.step(int(logits.argmax()))
    generated = cache.tokens[-8:]
    messages += [{"role": "assistant", "content": tok.decode(generated)}, user("And what then?")]
    prompt = tok.chat_ids(messages)
    assert cache.cache.max_len < len(prompt), "the test must make the cache grow"
    reused = cache.prefill(prompt)
    assert cache.tokens == prompt
    fresh = fresh_logits(pipe.model, prompt)
    assert_logits_match(reused, fresh, "turn 2 after reuse vs a fresh prefill")
    theirs = reference(torch.tensor([prompt])).logits[:, -1]  # (1, V)
    assert_logits_match(reused, theirs, "turn 2 after reuse vs transformers")


def test_reuse_when_the_template_drops_past_reasoning(pipe):
    """The cache holds `<think>R</think>answer` as generated; the next prompt renders the answer alone."""
    tok = pipe.tokenizer
    first = [user("Why is the sky blue?")]
    prompt1 = tok.chat_ids(first)
    generated = tok.encode("<think>\nBecause of Rayleigh scattering.\n</think>\n\nScattering.<|im_end|>")
    cache = ConversationCache(pipe.model)
    cache.prefill(prompt1 + generated)
    reply = {"role": "assistant", "content": "Scattering.", "reasoning_content": "Because of Rayleigh scattering."}
    prompt2 = tok.chat_ids(first + [reply, user("And at sunset?")])
    assert tok.encode("<think>")[0] not in prompt2[len(prompt1):], "the template should drop past reasoning"
    shared = common_prefix_length(cache.tokens, prompt2)
    assert len(prompt1) <= shared < len(cache.tokens), "the new prompt is not an append of the cached tokens"
    logits = cache.prefill(prompt2)
    assert cache.tokens == prompt2
    assert_logits_match(logits, fresh_logits(pipe.model, prompt2), "after dropping cached reasoning")


def test_editing_an_earlier_message_shrinks_the_reused_prefix(pipe):
    tok = pipe.tokenizer
    history = [user("Tell me a story."), {"role": "assistant", "content": "Once upon a time."}, user("More.")]
    cache = ConversationCache(pipe.model)
    cache.prefill(tok.chat_ids(history))
    edited = [user("Tell me a joke.")] + history[1:]
    prompt = tok.chat_ids(edited)
    shared = common_prefix_length(cache.tokens, prompt)
    assert shared < len(tok.chat_ids(history[:1], add_generation_prompt=False)), "the edit is in message 1"
    logits = cache.prefill(prompt)
    assert_logits_match(logits, fresh_logits(pipe.model, prompt), "after editing the first message")


def test_greedy_turns_equal_transformers_generate_turn_by_turn(pipe, reference):
    """Three turns through Pipeline.chat (cache reused) against transformers' greedy generate on each prompt."""
    messages, conversation = [], pipe.conversation
    for turn, text in enumerate(["Hello! How are you today?", "Please summarize that.", "Explain the cache."]):
        messages.append(user(text))
        reply = pipe.chat(messages, GREEDY)
        prompt, ours = conversation.last_prompt, conversation.last_ids
        if turn:
            assert conversation.last_stats.reused_tokens > 0, f"turn {turn + 1} must reuse the cache"
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
            eos_token_id=pipe.eos_ids, pad_token_id=pipe.tokenizer.pad_token_id,
        )  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        assert ours == theirs, f"turn {turn + 1}: ours {ours} vs transformers {theirs}"
        messages.append(reply)


def test_stream_pieces_add_up_to_the_message_and_closing_early_keeps_the_tokens_so_far(pipe):
    messages = [user("Count to ten.")]
    request = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    pieces = list(pipe.chat_stream(messages, request))
    full = pipe.conversation.last_message
    assert len(pieces) > 3, "the test needs an answer that streams in several pieces"
    assert "".join(p.text for p in pieces if p.kind == "content") == full["content"]
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == (full["reasoning_content"] or "")

    stream = pipe.chat_stream(messages, request)
    for _ in zip(range(3), stream):
        pass
    stream.close()  # what Ctrl-C does in the chat command
    cut = pipe.conversation.last_message
    assert 3 <= len(pipe.conversation.last_ids) < 16
    assert full["content"].startswith(cut["content"]), "an interrupted reply is a prefix of the whole one"
    # the cache stays consistent: the next turn's logits still equal a fresh prefill's
    prompt = pipe.tokenizer.chat_ids(messages + [cut, user("Go on.")])
    assert_logits_match(pipe.conversation.cache.prefill(prompt), fresh_logits(pipe.model, prompt), "after Ctrl-C")


def test_should_stop_ends_the_stream_after_the_token_it_was_asked_at_even_when_no_piece_shows(pipe):
    """The chat command's Ctrl-C is asked after every token: a stretch that shows nothing (a tool call being
    written, held until it closes) must still stop at once, with the reply as it was shown, as closing does."""
    messages = [user("Count to ten.")]
    request = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    pipe.chat(messages, request)
    full_ids, full = list(pipe.conversation.last_ids), pipe.conversation.last_message
    asked = []
    pieces = list(pipe.chat_stream(messages, request, should_stop=lambda: asked.append(1) or len(asked) >= 5))
    cut = pipe.conversation.last_message
    assert pipe.conversation.last_ids == full_ids[:5], "the stream ended right after the 5th token"
    assert "".join(p.text for p in pieces if p.kind == "content") == cut["content"], "the reply is what was shown"
    assert full["content"].startswith(cut["content"])
    prompt = pipe.tokenizer.chat_ids(messages + [cut, user("Go on.")])
    assert_logits_match(pipe.conversation.cache.prefill(prompt), fresh_logits(pipe.model, prompt), "after should_stop")


def test_an_int8_model_chats_with_its_cache_in_the_activations_dtype(checkpoint):
    """With int8 weights, two reused turns give the simple loop's greedy tokens on the same prompts (a KV
    cache in the int8 lm_head's dtype would truncate every key and drift), and the cache is bf16."""
    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.sampling.logits import LogitsFilter

    model = load_model(checkpoint, dtype="bfloat16", optimize="decode", quantize="int8")
    pipe = Pipeline(model, Tokenizer.from_checkpoint(checkpoint), checkpoint)
    messages = []
    for text in ["Hello! How are you today?", "Please summarize that."]:
        messages.append(user(text))
        messages.append(pipe.chat(messages, GREEDY))
        conversation = pipe.conversation
        alone = [int(t[0]) for t in generate_tokens(model, [conversation.last_prompt], GREEDY.max_tokens,
                                                     LogitsFilter(temperature=0.0), pipe.eos_ids)]  # fmt: skip
        assert conversation.last_ids == alone, "a chat turn on int8 weights differs from the simple loop"
    assert conversation.cache.cache.keys.dtype == torch.bfloat16
