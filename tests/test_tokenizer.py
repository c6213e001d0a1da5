"""Our Tokenizer against transformers' on the same folder, and streaming decode of split characters."""

import json

import pytest
import transformers
from make_tiny_checkpoint import SPECIAL_TOKENS, THINK_TOKENS, make_tiny_checkpoint
from tables import with_table

from qwen3_scratch.errors import CheckpointError
from qwen3_scratch.text.tokenizer import StreamingDetokenizer, Tokenizer

# Text the tiny tokenizer has seen, text it has not (龘, 🦙, 🧑‍🚀 are split into byte tokens),
# code, and control tokens written inline, as a chat prompt contains them.
SAMPLES = [
    "Hello world! The quick brown fox.",
    "你好，今天天气很好。龘龘 and 𠀀 are rare.",
    "Emoji: 🍕☕👍🎉 🦙 🧑‍🚀 ❤️ done",
    "def add(a, b):\n    return a + b\n\n\tx = [1, 22, 333]  # comment",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>",
    "  leading and trailing spaces  \n\n\n",
]
# Characters the corpus never shows, so byte-level BPE must split each over several tokens.
SPLIT_TEXT = "龘𠀀 🦙🧑‍🚀 你好世界 😀 ok 👍🏽 end"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module", params=["tokenizers", "table"])
def tokenizer(checkpoint, request):
    """Both ways a start gets the BPE: `tokenizers` parsing tokenizer.json, and text/bpe.py's table."""
    return Tokenizer.from_checkpoint(checkpoint) if request.param == "tokenizers" else with_table(checkpoint)


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    ours, theirs = tokenizer.encode(text), hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours == theirs, f"encode({text!r}) differs from transformers:\n ours   {ours}\n theirs {theirs}"
    # Qwen3 adds no BOS: transformers' default encode (add_special_tokens=True) must agree too.
    assert hf_tokenizer.encode(text) == ours, "transformers added tokens that Qwen3 should not add"


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_round_trips_and_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text, "decode(encode(text)) must give back the text exactly"
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        ), f"decode(skip_special_tokens={skip}) differs from transformers on {text!r}"


def test_special_tokens_map_to_their_ids_like_transformers(tokenizer, hf_tokenizer):
    for token in SPECIAL_TOKENS + THINK_TOKENS:
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None, f"{token} is missing from the vocabulary"
        assert token_id == hf_tokenizer.convert_tokens_to_ids(token), f"{token} has a different id in transformers"
        assert tokenizer.encode(token) == [token_id], f"{token} written in text must encode to its one id"
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>") == hf_tokenizer.eos_token_id
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>") == hf_tokenizer.pad_token_id
    assert tokenizer.bos_token is None, "Qwen3 has no BOS token"
    assert tokenizer.vocab_size == len(hf_tokenizer), "vocab_size must count the added tokens, like len(tokenizer)"
    assert tokenizer.token_to_id("no-such-token-anywhere") is None


def test_skip_special_tokens_drops_control_tokens_but_keeps_think_tags(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHi<|im_end|><|endoftext|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhmm\n</think>\n\nHi", (
        "skip_special_tokens must drop <|im_start|>, <|im_end|>, <|endoftext|> but keep <think> (not special)"
    )


def test_split_text_really_splits_characters_across_tokens(tokenizer):
    # Guards the streaming tests below: they prove nothing if no token ends mid-character.
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(SPLIT_TEXT)]
    assert any("\ufffd" in piece for piece in pieces), f"no token splits a character: {pieces}"


@pytest.mark.parametrize("text", [SPLIT_TEXT, *SAMPLES])
@pytest.mark.parametrize("skip", [False, True])
def test_streaming_never_emits_partial_characters_and_adds_up_to_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    stream = StreamingDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    for step, piece in enumerate(pieces):
        assert "\ufffd" not in piece, f"step {step} emitted half a character: {piece!r} (all pieces: {pieces})"
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip), (
        f"streamed text differs from one-shot decode: {pieces}"
    )


def test_streaming_emits_each_character_as_soon_as_it_is_complete(tokenizer):
    ids = tokenizer.encode("🦙")
    stream = StreamingDetokenizer(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert len(ids) > 1 and pieces[:-1] == [""] * (len(ids) - 1), f"emitted before the emoji was complete: {pieces}"
    assert pieces[-1] == "🦙" and stream.flush() == "", "the emoji must come out on its last byte, not at flush"


def test_flush_returns_an_unfinished_character_as_decode_would(tokenizer):
    first_byte = tokenizer.encode("🦙")[0]
    stream = StreamingDetokenizer(tokenizer)
    assert stream.push(first_byte) == "", "one byte of an emoji is not a character yet"
    assert stream.flush() == tokenizer.decode([first_byte]), "flush must hand over what is left, as decode shows it"


class CountingTokenizer(Tokenizer):
    """Records the longest id list passed to decode."""

    longest = 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_streaming_decodes_a_small_window_not_the_whole_sequence(checkpoint):
    counting = CountingTokenizer.from_checkpoint(checkpoint)
    ids = counting.encode(SPLIT_TEXT * 20)
    stream = StreamingDetokenizer(counting)
    "".join(stream.push(i) for i in ids)
    assert counting.longest <= 8, (
        f"a step decoded {counting.longest} tokens for a {len(ids)}-token text; the cost per token must not grow"
    )


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        Tokenizer.from_checkpoint(tmp_path)
    message = str(caught.value)
    assert "tokenizer.json" in message and str(tmp_path) in message, f"error must name the file: {message}"
    assert "\n" not in message, "user-facing errors are one line"


def test_corrupt_tokenizer_json_is_a_checkpoint_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_checkpoint(tmp_path)


def test_added_token_ids_that_contradict_tokenizer_json_are_refused(checkpoint, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    config = '{"added_tokens_decoder": {"7": {"content": "<|im_end|>", "special": true}}}'
    (tmp_path / "tokenizer_config.json").write_text(config, encoding="utf-8")
    with pytest.raises(CheckpointError, match="different checkpoints"):
        Tokenizer.from_checkpoint(tmp_path)


@pytest.mark.parametrize("separators", [(", ", " :  "), (",", ":\n\t"), (",", ":")])
def test_an_id_past_the_embedding_is_refused_however_tokenizer_json_is_spaced(checkpoint, tmp_path, separators):
    """The quick bound read from the file's bytes (Tokenizer._ids_below) must see every id: here one token moved
    to id 5000 (the tiny model has 1024+ rows), written with spaces or a line break around the colons, as JSON
    allows."""
    data = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab[next(token for token, i in vocab.items() if i == 1000)] = 5000
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, separators=separators), encoding="utf-8")
    for name in ("tokenizer_config.json",):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    tokenizer = Tokenizer.from_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="token ids up to 5000"):
        tokenizer.check_fits_model(2048, tmp_path)
    tokenizer.check_fits_model(5001, tmp_path)  # and a model with room for it takes it
