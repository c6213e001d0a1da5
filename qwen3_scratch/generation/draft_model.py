"""A draft model: a smaller Qwen3 with the target's tokenizer proposes the next k tokens, one step each.

Qwen3-0.6B reads ~1/13 of the bytes Qwen3-8B reads per token, and agrees with it on most easy tokens,
so k steps of the draft cost a fraction of one target step and the target checks them all in one
forward (speculative.py). The draft keeps its own KV cache, a ConversationCache: it remembers which
token fills each slot, so rolling back rejected proposals is forgetting the slots past the tokens
the target kept, and catching up is running only what the cache lacks (one token after a rejection,
two after a round whose proposals were all kept, a whole prompt's difference at a new chat turn).

With sampling, the draft draws each proposal from its own logits after the request's filters
(temperature, top-k, top-p, min-p), the same ones the target's distribution goes through, and hands
those distributions to the rejection sampling (sampling/rejection.py).

Shapes: k proposed tokens, V vocab.
"""

from pathlib import Path

import torch

from qwen3_scratch.errors import CheckpointError, printable
from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.rejection import distribution, draw
from qwen3_scratch.text.tokenizer import Tokenizer

from .conversation import ConversationCache
from .stats import bytes_per_decode_step


class DraftModel:
    def __init__(self, model: Qwen3, target: Qwen3):
        if model.config.vocab_size != target.config.vocab_size:
            raise CheckpointError(f"the draft model has {model.config.vocab_size} logits per token but the target "
                                  f"has {target.config.vocab_size}; a draft model must share its vocabulary")  # fmt: skip
        self.model = model
        self.cache = ConversationCache(model)
        # One draft step next to one target step, by the bytes each reads (decode is bound by reading
        # them): what AdaptiveK weighs a proposed token at.
        config = target.config
        self.cost = bytes_per_decode_step(model, model.config, 0, 1) / bytes_per_decode_step(target, config, 0, 1)

    def start(self, tokens: list[int]) -> None:
        """A new sequence: nothing to do, the cache keeps whatever prefix it shares with the old one."""

    def propose(self, tokens: list[int], k: int, params: LogitsFilter,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:  # fmt: skip
        """k tokens to follow `tokens`, and (sampling) the (k, V) distributions they were drawn from.
        [] when k is 0 or the draft's context cannot hold them."""
        if k < 1 or len(tokens) + k > self.model.config.max_position_embeddings:
            return [], None
        logits = self.cache.prefill(tokens, reserve=k)  # (1, V): runs only what the cache lacks
        proposed, probs = [], []
        for i in range(k):
            if params.greedy:
                proposed.append(int(logits.float().argmax()))
            else:
                q = distribution(logits, params)[0]  # (V,)
                proposed.append(draw(q, generator))
                probs.append(q)
            if i + 1 < k:
                logits = self.cache.step(proposed[-1])
        return proposed, torch.stack(probs) if probs else None  # (k, V) or None

    def rollback(self, length: int) -> None:
        """Forget the proposals the target did not keep: the cache keeps the first `length` tokens."""
        self.cache.truncate(min(length, len(self.cache.tokens)))


def check_draft_checkpoint(target_folder, target_tokenizer: Tokenizer, draft_folder) -> None:
    """Refuse a draft whose token ids mean other text than the target's (its proposals would be noise),
    or whose logits have another width, before either is loaded; the line names both files."""
    target_folder, draft_folder = Path(target_folder), Path(draft_folder)
    draft_tokenizer = Tokenizer.from_checkpoint(draft_folder)
    ours, theirs = (t.vocab() for t in (target_tokenizer, draft_tokenizer))
    if ours != theirs:
        raise CheckpointError(f"--draft-model: {printable(draft_folder / 'tokenizer.json')} ({len(theirs)} tokens) "
                              f"is not the vocabulary of {printable(target_folder / 'tokenizer.json')} "
                              f"({len(ours)} tokens); a draft model must use the target's tokenizer")  # fmt: skip
    sizes = [Qwen3Config.from_json(folder / "config.json").vocab_size for folder in (target_folder, draft_folder)]
    if sizes[0] != sizes[1]:
        raise CheckpointError(f"--draft-model: {printable(draft_folder / 'config.json')} says vocab_size={sizes[1]} "
                              f"but {printable(target_folder / 'config.json')} says {sizes[0]}; a draft model must "
                              "share the target's vocabulary")  # fmt: skip
