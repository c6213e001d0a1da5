"""`bad_words` as token ids: the token sequences that spell each word, for sampling/processors.py to ban.

vLLM's rule: each word alone, and with a leading space (how a word in running text is usually
tokenized). A word's text is encoded as text, never as the control token it might spell.
"""

from .tokenizer import Tokenizer


def bad_words_ids(tokenizer: Tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    found = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, split_special_tokens=True))
            if ids and ids not in found:
                found.append(ids)
    return tuple(found)
