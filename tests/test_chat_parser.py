"""The answer parser on hand-written token streams: reasoning, answer and tool calls kept apart.

Streams are written as text with Qwen3's tags and encoded with the tiny tokenizer, whose tags are
single added tokens exactly as in Qwen3's vocabulary. Every case is parsed twice, whole and one token
at a time, and the streamed deltas must add up to the whole message.
"""

import json

import pytest
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch.text.chat_parser import StreamParser, parse_assistant, prompt_opens_thinking
from qwen3_scratch.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def ids(tokenizer, text):
    return tokenizer.encode(text)  # tags and <|im_end|> written in the text become their single tokens


def streamed(tokenizer, token_ids, in_reasoning=False):
    """(message, deltas) from feeding the parser one token at a time."""
    parser = StreamParser(tokenizer, in_reasoning=in_reasoning)
    deltas = [d for t in token_ids for d in parser.push(t)] + parser.finish()
    return parser.message(), deltas


def parse_both_ways(tokenizer, text, in_reasoning=False):
    token_ids = ids(tokenizer, text)
    whole = parse_assistant(token_ids, tokenizer, in_reasoning=in_reasoning)
    message, deltas = streamed(tokenizer, token_ids, in_reasoning)
    assert without_ids(message) == without_ids(whole), "streaming and whole parsing must agree"
    joined = {kind: "".join(d.text for d in deltas if d.kind == kind) for kind in ("reasoning", "content")}
    assert joined["content"] == message["content"], f"content deltas do not add up: {deltas}"
    assert joined["reasoning"] == (message["reasoning_content"] or ""), f"reasoning deltas do not add up: {deltas}"
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    assert calls == message.get("tool_calls", []), "each finished call must be streamed once, in order"
    return whole


def without_ids(message):
    """The message with tool-call ids blanked (each parse draws new ones)."""
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}


def test_reasoning_and_answer_are_kept_apart(tokenizer):
    m = parse_both_ways(tokenizer, "<think>\nAdd the numbers.\n</think>\n\nIt is 4.<|im_end|>")
    assert m == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add the numbers."}


def test_an_answer_without_reasoning_has_none(tokenizer):
    m = parse_both_ways(tokenizer, "It is 4.<|im_end|>")
    assert m["content"] == "It is 4." and m["reasoning_content"] is None and "tool_calls" not in m


def test_reasoning_only_when_the_stream_ends_while_thinking(tokenizer):
    m = parse_both_ways(tokenizer, "<think>\nStill thinking about 你好")
    assert m["reasoning_content"] == "Still thinking about 你好" and m["content"] == ""


def test_a_think_block_opened_by_the_template(tokenizer):
    prompt = ids(tokenizer, "<|im_start|>assistant\n<think>\n")
    assert prompt_opens_thinking(prompt, tokenizer)
    assert not prompt_opens_thinking(ids(tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n"), tokenizer)
    assert not prompt_opens_thinking(ids(tokenizer, "<|im_start|>assistant\n"), tokenizer)
    m = parse_both_ways(tokenizer, "First, add.\n</think>\n\nIt is 4.", in_reasoning=True)
    assert m["reasoning_content"] == "First, add." and m["content"] == "It is 4."


def test_an_empty_think_block_is_empty_reasoning(tokenizer):
    m = parse_both_ways(tokenizer, "<think>\n\n</think>\n\nIt is 4.")
    assert m["reasoning_content"] == "" and m["content"] == "It is 4."


def test_a_tool_call(tokenizer):
    text = '<think>\nNeed weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "巴黎"}}\n</tool_call><|im_end|>'
    m = parse_both_ways(tokenizer, text)
    assert m["content"] == "" and m["reasoning_content"] == "Need weather."
    (call,) = m["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "巴黎"}, "arguments are JSON text, non-ASCII kept"


def test_two_parallel_calls_and_text_before_them(tokenizer):
    text = ('Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>')
    m = parse_both_ways(tokenizer, text)
    assert m["content"] == "Let me check both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]] == [
        ("a", {"x": 1}), ("b", {"y": [2]})
    ], "arguments given as a JSON string are accepted too"
    assert len({c["id"] for c in m["tool_calls"]}) == 2, "each call gets its own id"


@pytest.mark.parametrize("body", ['{"name": "a", "arguments": {"x": 1}', "not json", '["a"]', '{"arguments": {}}',
                                  '{"name": "a", "arguments": [1]}'])  # fmt: skip
def test_a_broken_call_stays_in_the_content_with_a_flag(tokenizer, body):
    m = parse_both_ways(tokenizer, f"Calling.\n<tool_call>\n{body}\n</tool_call>")
    assert "tool_calls" not in m
    assert m["content"] == f"Calling.\n<tool_call>\n{body}\n</tool_call>", "the block must stay, as it was written"
    assert len(m["tool_call_errors"]) == 1, m


def test_a_stream_cut_inside_a_tool_call_keeps_the_text(tokenizer):
    m = parse_both_ways(tokenizer, '<tool_call>\n{"name": "a", "argu')
    assert "tool_calls" not in m and m["content"] == '<tool_call>\n{"name": "a", "argu'
    assert "ended inside" in m["tool_call_errors"][0]


def test_tags_spelled_in_text_are_text(tokenizer):
    # "</think>" written as characters (not the tag token) must not end the reasoning.
    pieces = tokenizer.encode("a <") + tokenizer.encode("/think> b")
    assert tokenizer.token_to_id("</think>") not in pieces
    m = parse_assistant(ids(tokenizer, "<think>\n") + pieces, tokenizer)
    assert m["reasoning_content"] == "a </think> b" and m["content"] == ""


def test_control_tokens_are_not_text(tokenizer):
    m = parse_both_ways(tokenizer, "It is 4.<|im_end|><|endoftext|>")
    assert m["content"] == "It is 4."


def test_streamed_text_never_splits_a_character(tokenizer):
    text = "<think>\n想一想 🙂\n</think>\n\n答案是 4 👍🏽"
    token_ids = ids(tokenizer, text)
    assert len(token_ids) > len(text.split()), "byte-level pieces expected for rare characters"
    _, deltas = streamed(tokenizer, token_ids)
    assert all("\ufffd" not in d.text for d in deltas), [d.text for d in deltas]
    assert "".join(d.text for d in deltas if d.kind == "content") == "答案是 4 👍🏽"


def test_reasoning_tokens_are_counted(tokenizer):
    token_ids = ids(tokenizer, "<think>\nAdd.\n</think>\n\nIt is 4.")
    parser = StreamParser(tokenizer)
    for t in token_ids:
        parser.push(t)
    thinking = ids(tokenizer, "<think>\nAdd.\n</think>")
    assert parser.reasoning_tokens == len(thinking), "the tags and everything between them"
