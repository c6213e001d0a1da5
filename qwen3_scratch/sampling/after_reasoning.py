"""A grammar that starts after the reasoning: free tokens up to `</think>`, the grammar's after it.

Qwen3 in thinking mode writes `<think>\\n...\\n</think>\\n\\n` and then its answer, `</think>` one token
of its own. Structured output (a JSON schema, a forced tool call) is about the answer: constraining the
reasoning too would forbid the model's own `<think>`, so without this a constrained request had to be
rendered with thinking off. As vLLM's reasoning parser does, the grammar here governs only the tokens
after the end tag: before it the mask is absent (the draw is exactly the unconstrained one), the tag
itself passes through, and the grammar's first token is the one right after it. (The answer then
starts at once, with no "\\n\\n": the grammar decides what may come first.)

Bounded: with `budget`, once that many tokens were spent before the tag, the tag is the only token
allowed, so a model that would reason forever still answers, and under the grammar. Without one, the
request's max_tokens (or the context) ends it like any other.

Shapes: V vocab, W = ceil(V / 32) words of the bitmask.
"""

import torch


class GrammarAfterReasoning:
    """A sequence's place: still reasoning (free), or past `end_id` (its grammar's place). Same methods as Matcher."""

    def __init__(self, grammar, end_id: int, budget: int | None = None):  # grammar: a structured.Matcher
        self.grammar, self.end_id, self.budget = grammar, end_id, budget
        self.reasoning = True
        self.spent = 0  # tokens drawn before the end tag

    def bitmask(self) -> torch.Tensor | None:
        """(W,) int32 of the allowed tokens, or None while the reasoning is free."""
        if not self.reasoning:
            return self.grammar.bitmask()
        if self.budget is not None and self.spent >= self.budget:
            return only(self.end_id, self.grammar.vocab_size)
        return None

    def accept(self, token_id: int) -> None:
        if not self.reasoning:
            self.grammar.accept(token_id)
            return
        self.spent += 1
        self.reasoning = token_id != self.end_id


def only(token_id: int, vocab_size: int) -> torch.Tensor:
    """(W,) int32 with the one bit of token_id set."""
    mask = torch.zeros(-(-vocab_size // 32), dtype=torch.int64)
    mask[token_id // 32] = 1 << (token_id % 32)
    return mask.to(torch.int32)  # bit 31 wraps to the sign bit, as the bitmask's layout has it
