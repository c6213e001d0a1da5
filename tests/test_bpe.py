"""text/bpe.py, Qwen's BPE run from a stored table, against `tokenizers` reading the same tokenizer.json.

On Qwen3's real vocabulary (tests/real_vocab.py) and the tiny checkpoint's trained one: every text `encodes`
accepts gets `tokenizers`' ids, with and without control tokens read as text; every id list decodes to
`tokenizers`' text; and `Tokenizer` (text/tokenizer.py) answers from the table on a later start without
`tokenizers` parsing the file, rebuilds a table whose bytes changed, and leaves to `tokenizers` every
tokenizer.json and every text the table does not cover.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch.files import CACHE_ENV
from qwen3_scratch.text import bpe as bpe_module
from qwen3_scratch.text import tokenizer as tokenizer_module
from qwen3_scratch.text.bpe import TABLES_KEPT, ByteLevelBPE
from qwen3_scratch.text.tokenizer import Tokenizer

# Pieces the random texts are made of: the pattern's edge cases (contractions in any case, digits, runs of
# whitespace of every kind, line breaks), letters and marks of several scripts, characters that NFC composes,
# the characters `encodes` refuses (emoji, U+017F LONG S, unassigned), and control tokens.
PIECES = [
    *"abcXYZ019 .,!?-_=()[]{}<>|/\\\"'#@$%^&*~`;:+", " ", "  ", "\n", "\n\n", "\r\n", "\t", "\x0b", "\x0c",
    "'s", "'S", "'ll", "'LL", "'Re", "'ve", "'m", "'D", "'t", "'x", " 's", "\x1c", "\x1d", "\x1e", "\x1f",
    "\x85", "\xa0", "\u2028", "\u2029", "\u3000", "\u200b", "\ufeff", "\u180e", "\u00ad",
    "é", "e\u0301", "a\u0308", "\u0301", "\u0300\u0323", "ﬁ", "Å", "Å", "ß", "ẞ", "ſ", "ﬆ",
    "你好", "世界", "，", "。", "龘", "\U00020000", "こんにちは", "カタカナ", "한국어", "안녕",
    "Привет", "мир", "Ελληνικά", "नमस्ते", "مرحبا", "\u0660\u0661", "１２", "Ⅳ", "½", "²", "٣",
    "😀", "👍🏽", "👨‍👩‍👧", "\U0001fae0", "\u0378", "\U000e0001", "\ue000",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "<|im_start", "|>",
]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]
TEXTS = st.one_of(st.lists(st.sampled_from(PIECES), max_size=30).map("".join), st.text(max_size=30))
EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def their_ids(backend: tokenizers.Tokenizer, text: str, split_special_tokens: bool) -> list[int]:
    backend.encode_special_tokens = split_special_tokens
    return backend.encode(text, add_special_tokens=False).ids


def ours_and_theirs(folder):
    """(the table built from the folder's tokenizer.json, `tokenizers` reading the same file)."""
    ours = ByteLevelBPE.from_json(json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")))
    assert ours is not None, f"{folder}: a tokenizer.json of the kind bpe.py runs"
    return ours, tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def real(real_vocab_folder):
    """On Qwen3's real vocabulary."""
    return ours_and_theirs(real_vocab_folder)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """On the tiny checkpoint's trained vocabulary."""
    return ours_and_theirs(tiny_folder)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Tables on (the suite turns them off), in a cache of this test's own."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(bpe_module.ENV, "1")
    return tmp_path / "cache" / "tokenizers"


def stored(folder) -> Tokenizer:
    """A first start's tokenizer, its table then stored as the process it leaves behind would."""
    first = Tokenizer.from_checkpoint(folder)
    assert first.bpe is None and first._backend is not None, "a first start reads tokenizer.json with tokenizers"
    assert first.store_table(background=False)
    return Tokenizer.from_checkpoint(folder)


@pytest.mark.parametrize("which", ["real", "tiny"])
@EXAMPLES
@given(text=TEXTS)
def test_every_text_it_encodes_gets_tokenizers_ids(which, request, text):
    ours, theirs = request.getfixturevalue(which)
    if ours.encodes(text):
        for split in (False, True):
            assert ours.encode(text, split) == their_ids(theirs, text, split), (text, split)


def test_what_it_encodes_and_leaves_to_tokenizers(real):
    ours, theirs = real
    covered = ["I'm sure they'LL say it's fine; $12345.67\n\n", "def f(x):\n\treturn x  # ok\r\n",
               "你好，世界！龘\U00020000", "こんにちは、世界", "Привет, мир! 안녕하세요 नमस्ते مرحبا café naïve e\u0301",
               "  \u3000\xa0\x85 \x1c", "<|im_start|>user\nHi<|im_end|>"]  # fmt: skip
    for text in covered:
        assert ours.encodes(text), text
        assert ours.encode(text) == their_ids(theirs, text, False), text
    for text in ["😀", "ſ", "'ſ", "ß", "ﬆ", "\u0378", "\ue000", "\U0001fae0"]:  # emoji, folding, unassigned, private
        assert not ours.encodes(text), f"{text!r} must be left to tokenizers"


def test_every_character_it_encodes_gets_tokenizers_ids(real):
    """Each of the ~95,000 characters below U+30000 the table encodes, between letters, doubled, after a quote and
    a digit, before a line break: `tokenizers`' ids for every one. (The same texts with the ~360 characters that
    Unicode assigned or reclassed lately, which `encodes` refuses, differ between the two engines.)"""
    ours, theirs = real
    chars = [chr(c) for c in range(0x80, 0x30000) if not 0xD800 <= c < 0xE000 and ours.encodes(chr(c))]
    assert len(chars) > 90_000
    texts = [f"a{c}b {c}{c} 1'{c}\n" for c in chars]
    expected = theirs.encode_batch(texts, add_special_tokens=False)
    wrong = [text for text, want in zip(texts, expected) if ours.encode(text) != want.ids]
    assert not wrong, f"{len(wrong)} texts differ, the first {wrong[:5]!r}"


def test_a_long_run_with_no_break_merges_as_tokenizers_does(real):
    """One pre-token of thousands of characters (punctuation, spaces, digits are cut one by one): the merges run
    by a heap, in O(n log n), and still in `tokenizers`' order."""
    ours, theirs = real
    rng = random.Random(0)
    for alphabet in ("=-", "!?.", "  \t", "ab", "====----"):
        text = "".join(rng.choice(alphabet) for _ in range(3000))
        assert ours.encode(text) == their_ids(theirs, text, False), alphabet


@pytest.mark.parametrize("which", ["real", "tiny"])
def test_decode_gives_tokenizers_text(which, request):
    """Random ids (bytes that split characters, added tokens, special or not) decode as `tokenizers` decodes them,
    U+FFFD for each broken sequence included."""
    ours, theirs = request.getfixturevalue(which)
    rng = random.Random(1)
    top = theirs.get_vocab_size(with_added_tokens=True)
    added = list(theirs.get_added_tokens_decoder())
    for _ in range(3000):
        ids = [rng.choice(added) if rng.random() < 0.2 else rng.randrange(top) for _ in range(rng.randint(0, 8))]
        for skip in (False, True):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_lookups_are_tokenizers(real):
    ours, theirs = real
    assert ours.vocab_size == theirs.get_vocab_size(with_added_tokens=True) == 151669
    assert ours.max_id == 151668
    for token in ["Hello", "Ġworld", "<|im_end|>", "<think>", "ĠĠĠ", "not a token", "", "Ċ"]:
        assert ours.token_to_id(token) == theirs.token_to_id(token), token


def test_merges_written_as_strings_give_the_same_table(real_vocab_folder, real):
    """tokenizer.json files before tokenizers 0.20 write each merge as "a b", not ["a", "b"]."""
    data = json.loads((real_vocab_folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    old = ByteLevelBPE.from_json(data)
    ours, _ = real
    assert old is not None and (old.keys, old.ranks, old.cuts, old.blob) == (ours.keys, ours.ranks, ours.cuts, ours.blob)


PADDING = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
           "pad_token": "a"}  # fmt: skip


def _variants():
    def edit(path, value):
        def apply(data):
            *parents, last = path
            for key in parents:
                data = data[key]
            data[last] = value
        return apply

    def twice(data):
        data["model"]["merges"].append(list(data["model"]["merges"][-1]))

    def far_id(data):
        data["model"]["vocab"][next(iter(data["model"]["vocab"]))] = 10**9

    return {
        "no normalizer": edit(["normalizer"], None),
        "another pattern": edit(["pre_tokenizer", "pretokenizers", 0, "pattern"], {"Regex": r"\s+|\S+"}),
        "an added token that strips": edit(["added_tokens", 0, "lstrip"], True),
        "byte fallback": edit(["model", "byte_fallback"], True),
        "padding": edit(["padding"], PADDING),
        "a merge listed twice": twice,
        "an id far past the others": far_id,
    }


@pytest.mark.parametrize("variant", list(_variants()))
def test_a_tokenizer_json_it_does_not_run_is_left_to_tokenizers(tiny_folder, tmp_path, cache, variant):
    """Each variant changes what `tokenizers` does with the file; the table refuses it, and Tokenizer encodes with
    `tokenizers` from the start."""
    data = json.loads((tiny_folder / "tokenizer.json").read_text(encoding="utf-8"))
    _variants()[variant](data)
    assert ByteLevelBPE.from_json(data) is None
    folder = tmp_path / "variant"
    shutil.copytree(tiny_folder, folder)
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    try:
        theirs = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # a variant tokenizers refuses too (a merge of a token past the vocabulary, ...)
        return
    tokenizer = Tokenizer.from_checkpoint(folder)
    assert not tokenizer.store_table(background=False)
    assert Tokenizer.from_checkpoint(folder).bpe is None and not list(cache.glob("*.bpe"))
    text = "Hello world, it's 42<|im_end|>"
    assert tokenizer.encode(text) == their_ids(theirs, text, False)


def test_a_later_start_reads_the_table_not_tokenizer_json(real_vocab_folder, cache, monkeypatch):
    first = Tokenizer.from_checkpoint(real_vocab_folder)
    assert first.bpe is None, "no table before one is stored"
    assert first.store_table(background=False) and len(list(cache.glob("*.bpe"))) == 1
    assert not Tokenizer.from_checkpoint(real_vocab_folder).store_table(background=False), "stored already"

    def refuse(*args):
        raise AssertionError("a later start must not parse tokenizer.json")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", refuse)
    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", refuse)
    monkeypatch.setattr(bpe_module.ByteLevelBPE, "from_json", refuse)
    later = Tokenizer.from_checkpoint(real_vocab_folder)
    assert later.bpe is not None and later._backend is None
    text = "<|im_start|>user\nWhat's 2+2? 你好<|im_end|>\n"
    assert later.encode(text) == first.encode(text) == [151644, 872, 198, 3838, 594, 220, 17, 10, 17, 30, 220, 108386,
                                                        151645, 198]  # fmt: skip
    assert later.decode(later.encode(text)) == text and later.eos_token_id == 151645 and later.vocab_size == 151669


def test_tables_turned_off_are_neither_read_nor_stored(tiny_folder, cache, monkeypatch):
    assert stored(tiny_folder).bpe is not None
    monkeypatch.setenv(bpe_module.ENV, "0")
    off = Tokenizer.from_checkpoint(tiny_folder)
    assert off.bpe is None and not off.store_table(background=True)


def test_text_the_table_does_not_cover_reads_tokenizers_when_first_needed(real_vocab_folder, real, cache):
    tokenizer = stored(real_vocab_folder)
    assert tokenizer._backend is None
    _, theirs = real
    for text in ["plain", "an emoji 😀 <|im_end|>", "'ſ"]:
        for split in (False, True):
            assert tokenizer.encode(text, split) == their_ids(theirs, text, split), (text, split)
    assert tokenizer._backend is not None, "the emoji's text went to tokenizers"


def test_a_table_whose_bytes_changed_is_deleted_and_built_again(real_vocab_folder, cache):
    stored(real_vocab_folder)
    (table,) = cache.glob("*.bpe")
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 1
    table.write_bytes(bytes(data))
    digest = table.stem
    assert ByteLevelBPE.load(table, digest) is None and not table.exists()
    assert Tokenizer.from_checkpoint(real_vocab_folder).bpe is None, "read as a first start again"
    again = stored(real_vocab_folder)
    assert table.exists() and again.bpe is not None
    assert again.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_tables_follow_the_file_and_the_cache_keeps_the_last_few(tiny_folder, tmp_path, cache):
    """A table is the file's: a changed tokenizer.json gets its own (its ids, not the old file's), and the cache
    keeps the TABLES_KEPT most recently used."""
    data = json.loads((tiny_folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    word = max((t for t in vocab if t.isalpha()), key=len)  # a whole word of the tiny vocabulary
    folders = []
    for k in range(TABLES_KEPT + 2):
        folder = tmp_path / f"copy{k}"
        shutil.copytree(tiny_folder, folder)
        swapped = dict(data, model=dict(data["model"], vocab={**vocab, "a": vocab[word], word: vocab["a"]}))
        body = swapped if k % 2 else data
        (folder / "tokenizer.json").write_text(json.dumps(body, indent=k), encoding="utf-8")
        folders.append(folder)
        tokenizer = stored(folder)
        theirs = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert tokenizer.bpe is not None and tokenizer.encode(word) == their_ids(theirs, word, False)
    assert len(list(cache.glob("*.bpe"))) == TABLES_KEPT


def test_an_unwritable_cache_still_starts(tiny_folder, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # a folder below a file: nothing can be written
    monkeypatch.setenv(bpe_module.ENV, "1")
    tokenizer = Tokenizer.from_checkpoint(tiny_folder)
    assert not tokenizer.store_table(background=False) and not tokenizer.store_table(background=True)
    theirs = tokenizers.Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))
    assert tokenizer.encode("Hello world") == their_ids(theirs, "Hello world", False)


def test_the_tokenizer_module_keeps_its_refusals(tmp_path, cache):
    """Invalid JSON is still `tokenizers`' one-line refusal, not a table's."""
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {', encoding="utf-8")
    with pytest.raises(tokenizer_module.CheckpointError, match="cannot be read as a tokenizer"):
        Tokenizer.from_checkpoint(tmp_path)
    assert bpe_module.store(tmp_path / "tokenizer.json") is None and not cache.exists()


def test_a_pair_merges_only_where_its_merge_cuts_it(tmp_path):
    """"abc" is formed from ("ab", "c") only: after ("b", "c") has merged first, "a" + "bc" spells the token but is
    no merge, and `tokenizers` leaves it two tokens. A table that merged any pair spelling a token would not."""
    from real_vocab import byte_to_unicode
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(byte_to_unicode().values())
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("b", "c"), ("a", "b"), ("ab", "c")],
                                              continuing_subword_prefix="", end_of_word_suffix="", ignore_merges=False))  # fmt: skip
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(bpe_module.QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    backend.save(str(tmp_path / "tokenizer.json"))
    ours = ByteLevelBPE.from_json(json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8")))
    theirs = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["abc", "ab", "bc", "abcabc", "aabc", "abbc"]:
        assert ours.encode(text) == their_ids(theirs, text, False), text
    assert ours.encode("abc") == [vocab["a"], 256], "a + bc spells abc, but only ab + c is its merge"


def test_each_tokens_bytes_are_what_the_backend_gives(real_vocab_folder, cache):
    """token_bytes.py (a grammar's vocabulary, logprobs' `bytes`) reads the table: the same bytes as from
    `tokenizers`' vocabulary, for every id of Qwen3's embedding."""
    from qwen3_scratch.text.token_bytes import token_bytes, vocab_bytes

    ours = stored(real_vocab_folder)
    theirs = Tokenizer(tokenizers.Tokenizer.from_file(str(real_vocab_folder / "tokenizer.json")), {})
    assert ours.bpe is not None and theirs.bpe is None
    assert vocab_bytes(ours, 151936) == vocab_bytes(theirs, 151936)
    for token_id in (0, 198, 9707, 151643, 151667, 151669, 151935, 10**6):
        assert token_bytes(ours, token_id) == token_bytes(theirs, token_id), token_id


def test_the_vocabulary_from_the_table_is_tokenizers(real_vocab_folder, cache):
    """What a draft model's check compares (generation/draft_model.py, engine/draft_proposer.py)."""
    ours = stored(real_vocab_folder)
    assert ours.bpe is not None
    assert ours.vocab() == tokenizers.Tokenizer.from_file(str(real_vocab_folder / "tokenizer.json")).get_vocab(True)
    assert ours._backend is None, "listing the vocabulary needs no tokenizers object"


def test_a_cli_start_stores_the_table_once_it_has_exited(tiny_folder, cache, tmp_path):
    """qwen3-generate's first start reads tokenizer.json with tokenizers and leaves the table to a process that runs
    after it exits; the next start reads the table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "qwen3_scratch.generate", "--model", str(tiny_folder), "--prompt", "Hi",
               "--max-new-tokens", "2", "--temperature", "0"]  # fmt: skip
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "storing the tokenizer's table in the background" in first.stderr
    deadline = time.monotonic() + 120
    while not list(cache.glob("*.bpe")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(cache.glob("*.bpe"))) == 1, (cache / "build.log").read_text() if (cache / "build.log").exists() else ""
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "storing the tokenizer" not in second.stderr, second.stderr
    assert second.stdout == first.stdout, "the same tokens whichever way the BPE was read"
    assert Tokenizer.from_checkpoint(tiny_folder).bpe is not None


def test_the_command_stores_tables_now(tiny_folder, tmp_path, cache):
    bad = tmp_path / "bad.json"
    bad.write_text("{}", encoding="utf-8")
    assert bpe_module.main([str(tiny_folder)]) == 0 and len(list(cache.glob("*.bpe"))) == 1
    assert bpe_module.main([str(bad)]) == 1


def test_a_tokenizer_json_that_is_not_utf8_gets_no_table(tiny_folder, tmp_path, cache):
    """json.loads reads UTF-16 bytes too; Tokenizer refuses them (not UTF-8), so the table must not stand in."""
    folder = tmp_path / "utf16"
    shutil.copytree(tiny_folder, folder)
    (folder / "tokenizer.json").write_bytes((tiny_folder / "tokenizer.json").read_text(encoding="utf-8").encode("utf-16"))
    assert bpe_module.store(folder / "tokenizer.json") is None
    with pytest.raises(tokenizer_module.CheckpointError, match="not UTF-8"):
        Tokenizer.from_checkpoint(folder)


def test_a_tokenizer_json_changed_under_a_running_process_is_refused_not_mixed(tiny_folder, tmp_path, cache):
    """The table stood in for the file at the start; text it does not cover reads `tokenizers` from the file later.
    If the file has changed since, the two would be different tokenizers: refused in one line instead."""
    folder = tmp_path / "changing"
    shutil.copytree(tiny_folder, folder)
    tokenizer = stored(folder)
    assert tokenizer.bpe is not None and tokenizer._backend is None
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    (folder / "tokenizer.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    original = tokenizers.Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))
    assert tokenizer.encode("plain text") == their_ids(original, "plain text", False), "the table answers as before"
    with pytest.raises(tokenizer_module.CheckpointError, match="changed since this tokenizer was loaded"):
        tokenizer.encode("an emoji 😀")
