"""Qwen's byte-level BPE in Python, read from a table stored once per tokenizer.json: a start without the parse.

`tokenizers` builds its BPE from tokenizer.json at every start: ~0.5-0.65 s of a 2.5-3.5 s second start on a 2-core
AMD EPYC, its vocabulary and merges made into Rust maps (docs/performance.md). This file runs the same pipeline for
the one kind of tokenizer.json Qwen2 and Qwen3 ship, from a table that loads in ~30-50 ms:

    text -> cut at added tokens (<|im_start|>, <think>, ...; the longest at the leftmost place)
         -> each piece between them NFC-normalized -> split by Qwen's pattern -> each part's UTF-8 bytes written
            as GPT-2's byte characters -> byte-pair merges, the lowest-ranked pair first, the leftmost on ties
    ids  -> each id's bytes (added tokens as their UTF-8) -> UTF-8, a U+FFFD for each broken sequence

`ByteLevelBPE.from_json` refuses (None) any tokenizer.json that asks for more than this (another normalizer,
pattern, model option, padding, an added token that strips or normalizes, two merges that form one token): those
are left to `tokenizers`. And `encodes(text)` answers False for text with a character whose Unicode properties
may differ between the two regular-expression engines (the `regex` module here, Oniguruma in `tokenizers`):
characters assigned after Unicode 3.2, or whose category changed since, and the few that case-fold into the
pattern's letters. The caller encodes such text with `tokenizers`. tests/test_bpe.py holds both to `tokenizers`.

The table is built from the file (~1 s of Python) by a process a CLI leaves to run after it exits
(`store_in_background`), so a first start pays none of it, and kept in the cache folder under the file's SHA-256.
It holds the vocabulary sorted, for `bisect`, rather than as a dict: Python builds a 151k-entry dict in ~80-100 ms;
a sorted list of the same strings unmarshals in ~30. A pair (a, b) is a merge when a + b is a token whose one merge
cut it at len(a).
"""

import bisect
import hashlib
import heapq
import itertools
import json
import marshal
import operator
import os
import sys
import unicodedata
from array import array
from pathlib import Path

import regex

from qwen3_scratch import after_exit
from qwen3_scratch.files import cache_home

FORMAT = 1  # bumped whenever the table's contents or their meaning change
# The one pre-tokenizer pattern this file runs: Qwen2's and Qwen3's (tiktoken's cl100k pattern, digits one by one).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TABLES_KEPT = 8  # tables in the cache (~6 MB for Qwen3's vocabulary); the least recently used goes first
_CACHED_WORDS = 16384  # words whose ids are kept (HF keeps 10,000); the cache is emptied when full


def byte_chars() -> list[str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other 68 move to U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    moved = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


_BYTE_CHARS = byte_chars()
_BYTE_OF_CHAR = {c: b for b, c in enumerate(_BYTE_CHARS)}
# For str.translate: each byte character to its byte's Latin-1 character, and every other character below U+0100
# (those that byte-level BPE moved) to one Latin-1 cannot encode.
_TO_LATIN1 = {ord(c): b for c, b in _BYTE_OF_CHAR.items()}
_TO_LATIN1.update({b: 0x10FFFF for b in range(256) if chr(b) not in _BYTE_OF_CHAR})


def vocab_entry_bytes(token: str) -> bytes:
    """A vocabulary entry's bytes as `tokenizers`' ByteLevel decoder gives them: its byte characters' bytes, or its
    UTF-8 when any character is not a byte character."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode()


# The characters whose case folding is made of the letters in the pattern's (?i:'s|'t|...) (U+017F LONG S -> s,
# U+00DF -> ss, U+FB06 -> st, ...: every such one in Unicode 14): the two engines need not fold them alike.
_FOLDING = frozenset("\u00df\u017f\u1e9e\ufb05\ufb06")


def _stable(char: str) -> bool:
    """A non-ASCII character both engines class alike: assigned by Unicode 3.2 with the same category today."""
    category = unicodedata.category(char)
    return (
        category not in ("Cn", "Cs", "Co")
        and unicodedata.ucd_3_2_0.category(char) == category
        and char not in _FOLDING
    )


class ByteLevelBPE:
    """The BPE of a Qwen tokenizer.json: encode, decode and token lookups, with no `tokenizers` object."""

    def __init__(self, keys: list[str], key_ids: array, ranks: array, cuts: array, blob: bytes, offsets: array,
                 added: list[tuple[str, int, bool]], vocab_size: int):  # fmt: skip
        """keys: the model's tokens, sorted; key_ids/ranks/cuts: for keys[i] its id, the rank of the merge that
        forms it (-1: none) and that merge's cut (chars of its left part); blob/offsets: id i's bytes are
        blob[offsets[i]:offsets[i + 1]]; added: (content, id, special); vocab_size: `tokenizers`' count with added
        tokens."""
        self.keys, self.key_ids, self.ranks, self.cuts = keys, key_ids, ranks, cuts
        self.blob, self.offsets = blob, offsets
        self.added = added
        self.vocab_size = vocab_size
        self.added_ids = {content: i for content, i, _ in added}
        self.special_ids = frozenset(i for _, i, special in added if special)
        self._pattern = regex.compile(QWEN_PATTERN)
        longest_first = sorted(self.added_ids, key=len, reverse=True)
        plain_first = sorted((content for content, _, special in added if not special), key=len, reverse=True)
        self._cut_all = regex.compile("|".join(map(regex.escape, longest_first))) if added else None
        self._cut_plain = regex.compile("|".join(map(regex.escape, plain_first))) if plain_first else None
        self._words: dict[str, list[int]] = {}

    # --- encoding -------------------------------------------------------------------------------------------

    @staticmethod
    def encodes(text: str) -> bool:
        """Whether `encode(text)` is certain to give `tokenizers`' ids (see the module docstring)."""
        return text.isascii() or all(_stable(c) for c in set(text) if not c.isascii())

    def encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (no BOS). Added tokens written in it become their ids; with split_special_tokens,
        only the plain ones (<think>, <tool_call>), the special ones (<|im_start|>) being encoded as text.
        The caller checks `encodes(text)` first."""
        cut = self._cut_plain if split_special_tokens else self._cut_all
        ids: list[int] = []
        start = 0
        if cut is not None:
            for match in cut.finditer(text):
                self._encode_piece(text[start : match.start()], ids)
                ids.append(self.added_ids[match.group()])
                start = match.end()
        self._encode_piece(text[start:], ids)
        return ids

    def _encode_piece(self, text: str, ids: list[int]) -> None:
        if not text:
            return
        text = unicodedata.normalize("NFC", text)
        start = 0
        for match in self._pattern.finditer(text):  # "Isolated": the matches and the text between them
            if match.start() > start:
                ids += self._word(text[start : match.start()])
            ids += self._word(match.group())
            start = match.end()
        if start < len(text):
            ids += self._word(text[start:])

    def _word(self, part: str) -> list[int]:
        ids = self._words.get(part)
        if ids is None:
            ids = self._merge("".join(_BYTE_CHARS[b] for b in part.encode()))
            if len(self._words) >= _CACHED_WORDS:
                self._words.clear()
            self._words[part] = ids
        return ids

    def _find(self, token: str) -> int:
        """keys' index of `token`, or -1."""
        i = bisect.bisect_left(self.keys, token)
        return i if i < len(self.keys) and self.keys[i] == token else -1

    def _rank(self, left: str, right: str) -> int:
        i = self._find(left + right)
        return self.ranks[i] if i >= 0 and self.cuts[i] == len(left) else -1

    def _merge(self, word: str) -> list[int]:
        """Byte-pair merges as `tokenizers` does them: a heap of (rank, position), the lowest rank first and the
        leftmost on ties; an entry whose pair has changed since it was pushed is dropped. O(n log n) in the
        word's length, so a long run of punctuation or spaces costs no more than its length."""
        symbols: list[str | None] = list(word)
        n = len(symbols)
        after = list(range(1, n + 1))
        after[-1] = -1
        before = list(range(-1, n - 1))
        heap = [(rank, i) for i in range(n - 1) if (rank := self._rank(symbols[i], symbols[i + 1])) >= 0]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = after[i]
            if symbols[i] is None or j < 0 or self._rank(symbols[i], symbols[j]) != rank:
                continue
            symbols[i] += symbols[j]
            symbols[j] = None
            after[i] = after[j]
            if after[j] >= 0:
                before[after[j]] = i
            if before[i] >= 0 and (r := self._rank(symbols[before[i]], symbols[i])) >= 0:
                heapq.heappush(heap, (r, before[i]))
            if after[i] >= 0 and (r := self._rank(symbols[i], symbols[after[i]])) >= 0:
                heapq.heappush(heap, (r, i))
        return [self.key_ids[self._find(symbol)] for symbol in symbols if symbol is not None]

    # --- decoding and lookups --------------------------------------------------------------------------------

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """`tokenizers`' decode: ids it does not know are dropped; the bytes of the rest joined, then UTF-8."""
        blob, offsets, last = self.blob, self.offsets, len(self.offsets) - 1
        special = self.special_ids if skip_special_tokens else ()
        parts = [blob[offsets[i] : offsets[i + 1]] for i in ids if 0 <= i < last and i not in special]
        return b"".join(parts).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `decode` joins for this id (b"" for an id the tokenizer lacks)."""
        if not 0 <= token_id < len(self.offsets) - 1:
            return b""
        return self.blob[self.offsets[token_id] : self.offsets[token_id + 1]]

    def token_to_id(self, token: str) -> int | None:
        if token in self.added_ids:
            return self.added_ids[token]
        i = self._find(token)
        return None if i < 0 else self.key_ids[i]

    @property
    def max_id(self) -> int:
        return len(self.offsets) - 2

    # --- the table ----------------------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: dict) -> "ByteLevelBPE | None":
        """The BPE of a parsed tokenizer.json, or None when it is not the kind this file runs exactly."""
        if not _supported(data):
            return None
        model = data["model"]
        vocab, merges = model["vocab"], model["merges"]
        pairs = [m.split(" ") for m in merges] if merges and isinstance(merges[0], str) else merges
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            return None
        lefts, rights = [p[0] for p in pairs], [p[1] for p in pairs]
        if not set(map(type, lefts)) | set(map(type, rights)) <= {str}:
            return None
        formed = list(map(vocab.get, map(operator.add, lefts, rights)))  # the id each merge forms
        if (
            None in formed  # a merge forming what is not a token, or of parts that are not tokens: not ours to run
            or not vocab.keys() >= set(lefts) | set(rights)
            or len(set(formed)) != len(formed)  # two merges forming one token: `tokenizers` would rank them apart
        ):
            return None
        added = [(t["content"], t["id"], t["special"]) for t in data.get("added_tokens") or []]
        largest = max([*vocab.values(), *(i for _, i, _ in added)], default=-1)
        rank_of, cut_of = [-1] * (largest + 1), [0] * (largest + 1)  # by id
        for rank, i in enumerate(formed):
            rank_of[i] = rank
        for i, left in zip(formed, map(len, lefts)):
            cut_of[i] = left
        keys = sorted(vocab)
        ids = list(map(vocab.__getitem__, keys))
        key_ids = array("i", ids)
        ranks, cuts = array("i", map(rank_of.__getitem__, ids)), array("i", map(cut_of.__getitem__, ids))
        chunks: list[bytes] = [b""] * (largest + 1)
        for token, i in vocab.items():
            chunks[i] = vocab_entry_bytes(token)
        for content, i, _ in added:
            chunks[i] = content.encode()  # printable ASCII: the ByteLevel decoder's bytes are its UTF-8
        offsets = array("q", [0, *itertools.accumulate(map(len, chunks))])
        return cls(keys, key_ids, ranks, cuts, b"".join(chunks), offsets, added, len(vocab) + len(added))

    def save(self, path: Path, source_digest: str) -> None:
        """Write the table for the tokenizer.json whose SHA-256 is source_digest: beside, then renamed into place."""
        arrays = (self.key_ids.tobytes(), self.ranks.tobytes(), self.cuts.tobytes())
        fields = (FORMAT, source_digest, self.keys, *arrays, self.blob, self.offsets.tobytes(), self.added,
                  self.vocab_size)
        payload = marshal.dumps(fields)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(hashlib.sha256(payload).digest() + payload)
        partial.replace(path)

    @classmethod
    def load(cls, path: Path, source_digest: str) -> "ByteLevelBPE | None":
        """The table stored for that tokenizer.json, or None (none stored, another format, or bytes that no longer
        hash as written: such a file is deleted)."""
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data[32:]).digest() != data[:32]:
            path.unlink(missing_ok=True)
            return None
        try:
            fields = marshal.loads(data[32:])
        except (ValueError, EOFError, TypeError):
            return None
        if not isinstance(fields, tuple) or len(fields) != 10 or fields[0] != FORMAT or fields[1] != source_digest:
            return None
        _, _, keys, key_ids, ranks, cuts, blob, offsets, added, vocab_size = fields
        return cls(keys, _array("i", key_ids), _array("i", ranks), _array("i", cuts), blob, _array("q", offsets),
                   [tuple(a) for a in added], vocab_size)  # fmt: skip


def _array(kind: str, data: bytes) -> array:
    out = array(kind)
    out.frombytes(data)
    return out


def _supported(data: dict) -> bool:
    """tokenizer.json's pipeline is Qwen2/Qwen3's, field by field: anything else is for `tokenizers`."""
    model = data.get("model") or {}
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") or []
    added = data.get("added_tokens") or []
    return (
        data.get("truncation") is None
        and data.get("padding") is None
        and data.get("normalizer") == {"type": "NFC"}
        and pre.get("type") == "Sequence"
        and len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("pattern") == {"Regex": QWEN_PATTERN}
        and steps[0].get("behavior") == "Isolated"
        and steps[0].get("invert") is False
        and steps[1].get("type") == "ByteLevel"
        and steps[1].get("add_prefix_space") is False
        and steps[1].get("use_regex") is False
        and (data.get("decoder") or {}).get("type") == "ByteLevel"
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and model.get("unk_token") is None
        and model.get("continuing_subword_prefix") in (None, "")
        and model.get("end_of_word_suffix") in (None, "")
        and model.get("byte_fallback") is False
        and model.get("ignore_merges") is False
        and isinstance(model.get("vocab"), dict)
        and isinstance(model.get("merges"), list)
        and set(map(type, model["vocab"])) <= {str}
        and set(map(type, model["vocab"].values())) <= {int}
        and min(model["vocab"].values(), default=0) >= 0
        and all(c in model["vocab"] for c in _BYTE_CHARS)  # every text has its bytes' tokens
        and set(map(type, model["merges"])) <= {str, list}
        and all(
            isinstance(t, dict) and isinstance(t.get("content"), str) and t["content"]
            and type(t.get("id")) is int and t["id"] >= 0 and isinstance(t.get("special"), bool)
            and t.get("single_word") is False and t.get("lstrip") is False and t.get("rstrip") is False
            and t.get("normalized") is False
            and t["content"] not in model["vocab"]
            and t["content"].isascii() and t["content"].isprintable() and " " not in t["content"]
            for t in added
        )
        and len({t["content"] for t in added}) == len(added)
        and len({t["id"] for t in added} | set(model["vocab"].values())) == len(added) + len(model["vocab"])
        # ids about as many as the tokens (Qwen3's are 0 .. 151668): the table has a slot for every id up to the largest
        and max([*model["vocab"].values(), *(t["id"] for t in added)], default=0)
        < 2 * (len(model["vocab"]) + len(added)) + 1024
    )  # fmt: skip


# --- the cache: a table per tokenizer.json, built once after the first start ---------------------------------------


ENV = "QWEN3_SCRATCH_BPE_TABLES"  # 0: tables neither read nor stored, `tokenizers` at every start (the test suite's)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def table_path(digest: str) -> Path:
    return cache_home() / "tokenizers" / f"{digest}.bpe"


def digest(data: bytes) -> str:
    """What a table is kept under: the SHA-256 of its tokenizer.json's bytes."""
    return hashlib.sha256(data).hexdigest()


def load_stored(data: bytes) -> tuple["ByteLevelBPE | None", str]:
    """(the table stored for the tokenizer.json whose bytes are `data`, or None; the file's SHA-256)."""
    key = digest(data)
    if not enabled():
        return None, key
    table = table_path(key)
    bpe = ByteLevelBPE.load(table, key)
    if bpe is not None:
        try:
            os.utime(table)  # recently used: kept
        except OSError:
            pass
    return bpe, key


def store(file: Path) -> "ByteLevelBPE | None":
    """Build and store the table of the tokenizer.json `file`; None (nothing stored) when it is not the kind this
    file runs, not JSON, or the cache cannot be written."""
    try:
        data = Path(file).read_bytes()
        parsed = json.loads(data.decode("utf-8"))  # strictly UTF-8, as Tokenizer reads it (json.loads(bytes) is not)
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    bpe = ByteLevelBPE.from_json(parsed) if isinstance(parsed, dict) else None
    if bpe is None:
        return None
    key = digest(data)
    try:
        bpe.save(table_path(key), key)
        tables = sorted(table_path(key).parent.glob("*.bpe"), key=lambda f: f.stat().st_mtime, reverse=True)
        for old in tables[TABLES_KEPT:]:
            old.unlink(missing_ok=True)
    except OSError:
        return None
    return bpe


def store_in_background(file: Path) -> bool:
    """Store the table of `file` in a niced process once this one has exited (after_exit.py): a first start pays
    none of it. True if that process was started (a line on stderr says so)."""
    if not enabled():
        return False
    log = cache_home() / "tokenizers" / "build.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        after_exit.start("qwen3_scratch.text.bpe", [str(Path(file).resolve())], log)
    except OSError:  # a cache folder that cannot be written: every start parses tokenizer.json, as before
        return False
    print(f"[storing the tokenizer's table in the background, once per tokenizer.json; later starts read it instead "
          f"of parsing {Path(file).name}: {log.parent}]", file=sys.stderr)  # fmt: skip
    return True


def main(paths: list[str]) -> int:
    """Store the table of each checkpoint folder or tokenizer.json in `paths` (what store_in_background runs); 1 if
    any has none."""
    status = 0
    for path in map(Path, paths):
        file = path / "tokenizer.json" if path.is_dir() else path
        bpe = store(file)
        print(f"{file}: " + ("table stored" if bpe is not None else "no table (tokenizers reads it at every start)"))
        status |= bpe is None
    return status
