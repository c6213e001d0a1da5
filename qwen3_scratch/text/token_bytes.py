"""Each token's raw bytes: what a grammar engine matches against, and the `bytes` field of OpenAI's logprobs.

Decoding one token id alone can give "\ufffd" (a piece of a multi-byte character), so text cannot stand
for a token; its bytes can. Qwen3's BPE is byte-level (GPT-2's scheme): the vocabulary stores every byte
as one printable character, which `_BYTE_OF_CHAR` maps back. Added tokens (<|im_end|>, <think>) are
stored as their text, whose bytes are its UTF-8.
"""

from functools import lru_cache

from .tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted: the printable bytes stand for themselves,
    the other 68 are shifted to the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def vocab_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes of every id below vocab_size (the model's rows); ids the tokenizer lacks get b""."""
    if tokenizer.bpe is not None:  # the table holds them already (bpe.py), by the same rule
        return [tokenizer.bpe.token_bytes(i) for i in range(vocab_size)]
    table = _byte_of_char()
    added = {i: t.content.encode() for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
    out = [b""] * vocab_size
    for token, i in tokenizer.backend.get_vocab(with_added_tokens=False).items():
        if i < vocab_size:
            out[i] = bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
    for i, content in added.items():
        if i < vocab_size:
            out[i] = content
    return out


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """One token's bytes (see vocab_bytes)."""
    if tokenizer.bpe is not None:
        return tokenizer.bpe.token_bytes(token_id)
    added = tokenizer.backend.get_added_tokens_decoder().get(token_id)
    if added is not None:
        return added.content.encode()
    token = tokenizer.backend.id_to_token(token_id)
    if token is None:
        return b""
    table = _byte_of_char()
    return bytes(table[c] for c in token) if all(c in table for c in token) else token.encode()
