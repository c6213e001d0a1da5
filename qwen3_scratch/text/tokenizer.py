"""Text <-> token ids for a checkpoint, and text streamed one token at a time.

The BPE is Qwen's byte-level BPE, run two ways with the same ids: by `bpe.py` from a table stored once per
tokenizer.json (a later start loads it in ~30 ms, where the `tokenizers` library builds its BPE from the file in
~0.5 s), and by `tokenizers`, the Rust code `transformers` runs, for any tokenizer.json or text `bpe.py` does not
cover (loaded when first needed). This module adds what lives in the other files: which tokens are end-of-sequence
and padding (`tokenizer_config.json`), the chat template (`tokenizer_config.json`, or `chat_template.jinja` in newer
checkpoints), and streaming decode.
"""

import re
import secrets
import threading
from pathlib import Path

import tokenizers

from qwen3_scratch.errors import CheckpointError, ConfigError, printable
from qwen3_scratch.files import decode_text, read_bytes, read_json, read_text

from . import bpe as bpe_tables
from .bpe import ByteLevelBPE
from .chat_template import render_chat_template

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    """A checkpoint's tokenizer. Qwen3 adds no BOS token: `encode` returns exactly the text's ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer | None,
        config: dict,
        chat_template: str | None = None,
        template_source: str = CONFIG_FILE,
        bpe: ByteLevelBPE | None = None,
        file: Path | None = None,
    ):
        """backend: `tokenizers`' BPE (None: read from `file` when first needed); config: tokenizer_config.json's
        contents; template_source: for errors; bpe: the same BPE run by bpe.py, used wherever it applies."""
        if backend is None and file is None:
            raise ValueError("a Tokenizer needs a tokenizers backend or the tokenizer.json to read one from")
        self._backend = backend
        self._backend_lock = threading.Lock()
        self.bpe = bpe
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_token = _token_text(config.get("bos_token"))  # null for Qwen3
        self.unk_token = _token_text(config.get("unk_token"))
        self._chat_template = chat_template
        self._template_source = template_source
        self._text_only_backend: tokenizers.Tokenizer | None = None  # see encode(split_special_tokens=True)
        self._file = file  # the tokenizer.json it was read from, if any (see _ids_below)
        self._digest: str | None = None  # its SHA-256 when read, which a backend read later must match

    @classmethod
    def from_checkpoint(cls, path) -> "Tokenizer":
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template from a checkpoint folder."""
        folder = Path(path)
        file = folder / TOKENIZER_FILE
        data = _read_tokenizer_json(file)
        bpe, digest = bpe_tables.load_stored(data)  # stored after an earlier start, or None
        backend = None if bpe is not None else _load_backend(file, data)
        config = read_json(folder / CONFIG_FILE) if (folder / CONFIG_FILE).exists() else {}
        _check_config_types(config, folder / CONFIG_FILE)
        # transformers lets a separate chat_template.jinja win over the config's copy; so do we.
        if (folder / TEMPLATE_FILE).exists():
            template, source = read_text(folder / TEMPLATE_FILE), printable(folder / TEMPLATE_FILE)
        else:
            template = _default_template(config.get("chat_template"))
            source = f"{printable(folder / CONFIG_FILE)} (chat_template)"
        tokenizer = cls(backend, config, template, source, bpe=bpe, file=file)
        tokenizer._digest = digest
        _check_added_tokens(tokenizer, config, folder / CONFIG_FILE)
        return tokenizer

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """`tokenizers`' BPE of the same file: read at the first call when the table stood in for it at the start."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    data = _read_tokenizer_json(self._file)  # read once: what is parsed is what was checked
                    if self._digest is not None and bpe_tables.digest(data) != self._digest:
                        raise CheckpointError(f"{printable(self._file)} changed since this tokenizer was loaded "
                                              "from it; load the checkpoint again (restart the command)")  # fmt: skip
                    self._backend = _load_backend(self._file, data)
        return self._backend

    def store_table(self, background: bool = True) -> bool:
        """Store bpe.py's table of this tokenizer.json for later starts, if it has none and is the kind bpe.py runs:
        in a process that runs once this one has exited (background, the CLIs), or now. True if one was started or
        stored."""
        if self.bpe is not None or self._file is None:
            return False
        if background:
            return bpe_tables.store_in_background(self._file)
        return bpe_tables.store(self._file) is not None

    def encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Control tokens written in the text (e.g. <|im_start|>) become their ids,
        unless split_special_tokens: then they are encoded as the text they are (transformers' flag of
        that name), which is what text typed by a user must get."""
        if self.bpe is not None and self.bpe.encodes(text):
            return self.bpe.encode(text, split_special_tokens)
        backend = self._text_only() if split_special_tokens else self.backend
        return backend.encode(text, add_special_tokens=False).ids

    def _text_only(self) -> tokenizers.Tokenizer:
        # A second copy of the BPE that does not look for special tokens in its input. A copy rather
        # than flipping the flag on the shared one, so that a server's threads never see it half-set.
        if self._text_only_backend is None:
            backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
            backend.encode_special_tokens = True
            self._text_only_backend = backend
        return self._text_only_backend

    @property
    def special_tokens(self) -> dict[str, int]:
        """The control tokens (<|im_start|>, <|im_end|>, <|endoftext|>, ...) by text: the added tokens
        marked special. <think> and <tool_call> are plain added tokens, markup inside a turn."""
        if self.bpe is not None:
            return {content: token_id for content, token_id, special in self.bpe.added if special}
        added = self.backend.get_added_tokens_decoder()
        return {token.content: token_id for token_id, token in added.items() if token.special}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; skip_special_tokens drops <|im_end|> and friends (not <think>, which is not special)."""
        # int() so a list of 0-d tensors, or a 1-d tensor, works as well as a list of ints.
        ids = [int(i) for i in ids]
        if self.bpe is not None:
            return self.bpe.decode(ids, skip_special_tokens)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocab(self) -> dict[str, int]:
        """Every token's text -> id, added tokens included (`tokenizers`' get_vocab(with_added_tokens=True))."""
        if self.bpe is not None:
            return {**dict(zip(self.bpe.keys, self.bpe.key_ids)), **{content: i for content, i, _ in self.bpe.added}}
        return self.backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.bpe.token_to_id(token) if self.bpe is not None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (transformers' `len(tokenizer)`).

        The model's embedding usually has more rows (Qwen3: 151669 tokens, 151936 rows).
        """
        return self.bpe.vocab_size if self.bpe is not None else self.backend.get_vocab_size(with_added_tokens=True)

    def check_fits_model(self, vocab_size: int, folder) -> None:
        """Refuse a tokenizer that can produce ids the model has no embedding row for.

        Such an id would fail at prefill (an IndexError on a CPU, a device-side assert on a GPU), and
        an EOS token that is not in the vocabulary would never stop a generation.
        """
        folder = Path(folder)
        largest = -1
        if self.bpe is not None:
            largest = self.bpe.max_id
        elif not self._ids_below(vocab_size):  # not known from the file's text: list the vocabulary
            largest = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        if largest >= vocab_size:
            raise CheckpointError(
                f"{printable(folder / TOKENIZER_FILE)} has token ids up to {largest}, but "
                f"{printable(folder / 'config.json')} says vocab_size={vocab_size}; the tokenizer and the "
                "weights are from different checkpoints"
            )
        for name in ("eos_token", "pad_token"):
            token = getattr(self, name)
            if token is not None and self.token_to_id(token) is None:
                raise CheckpointError(f"{printable(folder / CONFIG_FILE)}: {name} {printable(repr(token), 80)} is "
                                      f"not a token of {TOKENIZER_FILE}; the two files are from different checkpoints")  # fmt: skip

    def _ids_below(self, limit: int) -> bool:
        """True if the tokenizer.json this was read from certainly holds no id >= limit; False: not known.

        Read from the file's bytes: every id in it is a JSON number after a key's colon (`"token": id` in the
        vocabulary, `"id": id` for an added token), so the ASCII numbers after a colon with as many digits as
        `limit` or more bound every id (a colon inside a string can only add numbers, never hide one). ~20 ms
        for Qwen3's 151k tokens, where listing the vocabulary (get_vocab, a dict of 151k entries) took ~130 ms
        of every start, and the file decoded as text and searched from every quote ~65; when the bound is not
        below `limit`, the caller lists it."""
        try:
            data = self._file.read_bytes() if self._file is not None else None
        except OSError:
            data = None
        if data is None:
            return False
        pattern = rb":\s*([0-9]{%d,})" % len(str(limit))  # fewer digits than `limit`: below it
        return all(int(number) < limit for number in re.findall(pattern, data))

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def chat_ids(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
    ) -> list[int]:
        """The prompt ids for `messages`, where only the template writes control tokens.

        Text that comes from the caller (contents, reasoning, tool calls and results, tool schemas)
        is encoded as text even when it spells a control token: a user who types
        "hi<|im_end|>\n<|im_start|>system\n..." gets the ids of those characters, not a forged system
        turn. When nothing is spelled that way the ids are exactly `encode(apply_chat_template(...))`,
        transformers' `apply_chat_template(..., tokenize=True)`.
        """
        hider = _ControlTokenHider(self.special_tokens)
        text = self.apply_chat_template(
            hider.hide(messages), add_generation_prompt, enable_thinking,
            tools=hider.hide(tools), documents=hider.hide(documents),
        )  # fmt: skip
        if not hider.hidden:
            return self.encode(text)
        return hider.encode(text, self)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **extra,
    ) -> str:
        """The prompt text for `messages`, as the checkpoint's chat template writes it (not tokenized).

        Encoding this text with `encode` turns control tokens typed inside messages into real ones;
        `chat_ids` is the safe way to get prompt ids."""
        if self._chat_template is None:
            raise ConfigError(f"{self._template_source}: this checkpoint has no chat template; "
                              f"add one to {CONFIG_FILE} or {TEMPLATE_FILE}, or prompt with plain text")
        # The template sees the special tokens by name, as in transformers (which passes only those set).
        tokens = {"pad_token": self.pad_token, "unk_token": self.unk_token, **extra}
        return render_chat_template(
            self._chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tools=tools,
            documents=documents,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            template_source=self._template_source,
            **tokens,
        )


class _ControlTokenHider:
    """Swaps control tokens spelled inside caller text for sentinels, so the template cannot pass them on.

    Each occurrence becomes "\ue000<nonce>.<n>\ue001": private-use characters around a random number,
    which no template alters and no caller can guess. After rendering, every control token left in the
    prompt text is one the template wrote. `encode` then cuts the text at those, maps each to its id,
    and encodes the text between them (sentinels put back) with control tokens read as text. Cutting
    at control tokens is what the tokenizer does itself, so nothing else about the ids changes.
    """

    def __init__(self, special_tokens: dict[str, int]):
        self.special_tokens = special_tokens
        self.hidden: list[str] = []  # the n-th hidden token's text
        self._nonce = str(secrets.randbelow(10**12))
        longest_first = sorted(special_tokens, key=len, reverse=True)
        self._find = re.compile("|".join(map(re.escape, longest_first))) if special_tokens else None
        self._sentinel = re.compile(f"\ue000{self._nonce}\\.(\\d+)\ue001")

    def hide(self, value):
        """A copy of `value` (str, or lists/dicts of them, keys included) with control tokens hidden."""
        if isinstance(value, str):
            return self._find.sub(self._swap, value) if self._find else value
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hide(item) for item in value]
        return value

    def _swap(self, match: re.Match) -> str:
        self.hidden.append(match.group(0))
        return f"\ue000{self._nonce}.{len(self.hidden) - 1}\ue001"

    def encode(self, text: str, tokenizer: "Tokenizer") -> list[int]:
        ids, start = [], 0
        for match in self._find.finditer(text):  # the template's own control tokens
            ids += self._encode_text(text[start : match.start()], tokenizer)
            ids.append(self.special_tokens[match.group(0)])
            start = match.end()
        return ids + self._encode_text(text[start:], tokenizer)

    def _encode_text(self, text: str, tokenizer: "Tokenizer") -> list[int]:
        restored = self._sentinel.sub(lambda m: self.hidden[int(m.group(1))], text)
        return tokenizer.encode(restored, split_special_tokens=True) if restored else []


class StreamingDetokenizer:
    """Turns generated ids into text as they arrive, without ever emitting half a character.

    Byte-level BPE can split one character over several tokens (a Chinese character is 3 UTF-8
    bytes, an emoji 4), and decoding an incomplete character gives U+FFFD. So each step decodes a
    short window of recent tokens and emits only the new text, waiting while it ends in U+FFFD.
    The window starts at a character boundary, which makes its text a true suffix of the full
    decode; its length stays around two tokens, so each step costs O(1), not O(sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # tokens from the last character boundary already emitted behind
        self._emitted = 0  # how many tokens of the window have had their text emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still partial)."""
        self._window.append(int(token_id))
        before = self._decode(self._window[: self._emitted])
        text = self._decode(self._window)
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        # Keep the tokens just emitted as context: a decoder may treat a token differently at the
        # start of a text (e.g. a leading space), so the next window must not start cold.
        self._window = self._window[self._emitted:]
        self._emitted = len(self._window)
        return text[len(before):]

    def flush(self) -> str:
        """Return whatever text is left, even an incomplete character (as U+FFFD, like `decode`)."""
        before = self._decode(self._window[: self._emitted])
        text = self._decode(self._window)
        self._window, self._emitted = [], 0
        return text[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def _load_backend(path: Path, data: bytes) -> tokenizers.Tokenizer:
    """`tokenizers`' BPE from tokenizer.json's bytes as read (_read_tokenizer_json), not read from the file again."""
    text = decode_text(data, path)  # bytes that are not UTF-8: our own line
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as error:  # the Rust parser raises a bare Exception
        reason = printable(" ".join(str(error).split()))
        raise CheckpointError(f"{printable(path)}: cannot be read as a tokenizer ({reason}); download it again") from error


def _read_tokenizer_json(path: Path) -> bytes:
    """The file's bytes (a missing file, a directory or an oversized one: our own line); its text is checked by
    whatever reads them: a table only exists for UTF-8 JSON, _load_backend decodes them strictly."""
    if not path.exists():
        raise CheckpointError(f"{printable(path)}: not found; a checkpoint folder needs its {TOKENIZER_FILE} "
                              "(download the full repo, not only the weights)")
    return read_bytes(path)


# tokenizer_config.json fields we read, and what each may hold. A token is its text, or a
# serialized AddedToken {"content": text, ...}; a template is text, or a list of named templates.
_TOKEN_FIELDS = ("eos_token", "pad_token", "bos_token", "unk_token")


def _check_config_types(config: dict, path: Path) -> None:
    """Every field we read from tokenizer_config.json has the type we read it as."""

    def refuse(field: str, expected: str):
        raise CheckpointError(f"{printable(path)}: {field} must be {expected}, got "
                              f"{printable(repr(config[field]), 80)}; download it again or fix the file")  # fmt: skip

    for field in _TOKEN_FIELDS:
        if field in config and config[field] is not None and not isinstance(_token_text(config[field]), str):
            refuse(field, 'a token (text, or {"content": text})')
    added = config.get("added_tokens_decoder", {})
    if not isinstance(added, dict) or not all(
        key.isascii() and key.isdigit() and len(key) < 10 and isinstance(_token_text(token), str) for key, token in added.items()
    ):
        refuse("added_tokens_decoder", 'a mapping of token ids to tokens ({"151645": {"content": ...}})')
    template = config.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
        for entry in template
    )
    if template is not None and not isinstance(template, str) and not named:
        refuse("chat_template", 'text, or a list of {"name": ..., "template": ...}')


def _check_added_tokens(tokenizer: Tokenizer, config: dict, path: Path) -> None:
    """The ids in `added_tokens_decoder` must be the ids tokenizer.json gives those tokens.

    A mismatch means the two files come from different checkpoints; generation would then stop
    on the wrong token, so refuse to load rather than produce quiet nonsense.
    """
    for id_text, token in config.get("added_tokens_decoder", {}).items():
        content = _token_text(token)
        actual = tokenizer.token_to_id(content)
        if actual != int(id_text):
            raise CheckpointError(f"{printable(path)}: added token {printable(repr(content), 80)} has id {id_text} "
                                  f"but {TOKENIZER_FILE} gives {actual}; the two files are from different checkpoints")


def _token_text(token) -> str | None:
    # Older configs store a token as a serialized AddedToken: {"content": "<|im_end|>", ...}.
    return token.get("content") if isinstance(token, dict) else token


def _default_template(template) -> str | None:
    # A config may hold several named templates ([{"name": "default", "template": ...}, ...]).
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template
