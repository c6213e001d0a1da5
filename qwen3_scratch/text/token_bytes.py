"""Each token's raw bytes: what a grammar engine matches against, and the `bytes` field of OpenAI's logprobs.

Decoding one token id alone can give "\ufffd" (a piece of a multi-byte character), so text cannot stand
for a token; its bytes can. Qwen3's BPE is byte-level (GPT-2's scheme): the vocabulary stores every byte
as one printable character, which `bpe.vocab_entry_bytes` maps back. Added tokens (<|im_end|>, <think>) are
stored as their text, whose bytes are its UTF-8. A tokenizer read from bpe.py's table has them all already.
"""

from .bpe import vocab_entry_bytes
from .tokenizer import Tokenizer


def vocab_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes of every id below vocab_size (the model's rows); ids the tokenizer lacks get b""."""
    if tokenizer.bpe is not None:  # the table holds them already (bpe.py), by the same rule
        return [tokenizer.bpe.token_bytes(i) for i in range(vocab_size)]
    added = {i: t.content.encode() for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
    out = [b""] * vocab_size
    for token, i in tokenizer.backend.get_vocab(with_added_tokens=False).items():
        if i < vocab_size:
            out[i] = vocab_entry_bytes(token)
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
    return vocab_entry_bytes(token)
