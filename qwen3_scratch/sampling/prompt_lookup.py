"""Prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's last few tokens.

When an answer quotes its input (a summary, an edited file, an extraction, a chat that repeats
earlier turns), the next tokens are often a copy of what followed the same words earlier in the
prompt or the output. Prompt lookup proposes that copy: find the longest suffix of the sequence, at
most `max_ngram` and at least `min_ngram` tokens, that occurred earlier, and propose the k tokens that
followed its latest earlier occurrence. No second model, no forward pass: a dictionary lookup.
(transformers' `prompt_lookup_num_tokens`, vLLM's `ngram` method; both take the earliest match, we
take the latest, which in a repeating answer is the repetition in progress.)

The proposals are checked by the target like any other (generation/speculative.py, engine/speculative.py): a wrong guess costs a longer
verification forward, never a wrong token.
"""

import torch

from .logits import LogitsFilter


class PromptLookup:
    """An index of the sequence's n-grams (n = 1..max_ngram) -> where each occurred last, kept up to
    date as the sequence grows, so a proposal costs a few dictionary lookups, not a scan."""

    cost = 0.0  # a proposed token costs nothing next to a forward pass (generation/speculative.AdaptiveK)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.start([])

    def start(self, tokens: list[int]) -> None:
        """Begin a new sequence (a prompt): forget the old index."""
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> the position of its last token, latest occurrence
        self.indexed = 0  # the n-grams ending before this position are in last_end

    def propose(self, tokens: list[int], k: int, params: LogitsFilter | None = None,
                generator: torch.Generator | None = None) -> tuple[list[int], None]:  # fmt: skip
        """Up to k tokens to follow `tokens` (which extends the sequence seen so far), proposed with
        certainty (no distribution: None). [] when no suffix occurred before."""
        if k < 1:
            return [], None
        self._index(tokens, len(tokens) - 1)  # n-grams ending before the newest token: earlier occurrences only
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return self._continuation(tokens, end + 1, k), None
        return [], None

    def rollback(self, length: int) -> None:
        """Nothing to undo: only accepted tokens are ever indexed."""

    def _index(self, tokens: list[int], end: int) -> None:
        for i in range(self.indexed, end):
            for n in range(1, min(self.max_ngram, i + 1) + 1):
                self.last_end[tuple(tokens[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end)

    @staticmethod
    def _continuation(tokens: list[int], start: int, k: int) -> list[int]:
        """tokens[start : start + k], continued periodically where it runs past the end: in "a b c a b"
        the earlier "a b" continues "c a b c a" (each token past the end repeats the one a period back)."""
        proposal = []
        for i in range(start, start + k):
            proposal.append(tokens[i] if i < len(tokens) else proposal[i - len(tokens)])
        return proposal
