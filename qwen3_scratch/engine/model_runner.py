"""One scheduled step -> the model's forward passes -> next-token logits per sequence.

The runner turns the scheduler's chunks into the tensors `Qwen3.forward` takes: token ids, RoPE
positions, an attention mask, and a `PagedView` of the pool as the cache. The model is the same
one the simple loops use; it never learns that its cache is paged.

One step is at most 1 + P forwards:
  - all decodes together: (B, 1) tokens, each row attending over its own keys, read in place through
    its block table (on a CPU; elsewhere gathered), the tables right-padded to the longest row (the
    mask hides the padding);
  - each prompt chunk alone: (1, T) tokens attending over its cached prefix, gathered, and itself, causally.
Putting a chunk of T tokens in the decode batch would pad every decode row to T tokens.

Shapes: B rows, T tokens per row, S keys per row, V vocab, bs block_size.
"""

import torch

from qwen3_scratch.model.qwen3 import Qwen3

from .paged_cache import PagedKVCache
from .scheduler import Chunk, ScheduledBatch


class ModelRunner:
    def __init__(self, model: Qwen3, cache: PagedKVCache):
        self.model, self.cache = model, cache
        self.device = model.device
        self.prompt_logits: dict[int, torch.Tensor] = {}  # the last run's, see run()

    @torch.no_grad()
    def run(self, batch: ScheduledBatch) -> dict[int, torch.Tensor]:
        """Run every chunk; returns {id(seq): logits (V,)} for the chunks that end at their newest token."""
        logits: dict[int, torch.Tensor] = {}
        if batch.decodes:
            rows = self.decode(batch.decodes)  # (B, V)
            logits.update((id(chunk.seq), row) for chunk, row in zip(batch.decodes, rows))
        self.prompt_logits = {}  # {id(seq): (T, V)} for the chunks of requests that score their prompt
        for chunk in batch.prefills:
            rows = self.prefill(chunk)  # (T, V) for a request scoring its prompt, else (1, V)
            if chunk.seq.wants_prompt_logprobs:
                self.prompt_logits[id(chunk.seq)] = rows
            if chunk.samples:
                logits[id(chunk.seq)] = rows[-1]
        return logits

    def decode(self, chunks: list[Chunk]) -> torch.Tensor:
        """The newest token of every row at once -> logits (B, V)."""
        lengths = [chunk.end for chunk in chunks]  # keys per row, the new token's included
        tables = self.block_tables([c.seq.block_table for c in chunks], max(lengths))  # (B, W)
        # Attend over every slot of the tables' blocks (S = W x block_size), the padding masked: gathered
        # keys then reach attention whole, with no slice, and in place the mask is one flag per slot.
        S = tables.shape[1] * self.cache.block_size
        tokens = torch.tensor([[c.seq.token_ids[c.start]] for c in chunks], device=self.device)  # (B, 1)
        positions = torch.tensor([[c.start] for c in chunks], device=self.device)  # (B, 1)
        write = self.slots(tables, positions)  # (B, 1): the new token's own slot
        keys = torch.arange(S, device=self.device)
        valid = keys[None, :] < torch.tensor(lengths, device=self.device)[:, None]  # (B, S)
        mask = valid[:, None, None, :]  # (B, 1, 1, S): a row sees its own keys, not the padding
        view = self.cache.decode_view(write, tables)
        return self.model(tokens, positions, mask, view, write, last_only=True)[:, -1]  # (B, V)

    def prefill(self, chunk: Chunk) -> torch.Tensor:
        """Tokens [start, end) of one sequence, after its cached prefix [0, start) -> logits (1, V) of the last,
        or (T, V) of every position when its request scores the prompt."""
        seq, start, end = chunk.seq, chunk.start, chunk.end
        tokens = torch.tensor([seq.token_ids[start:end]], device=self.device)  # (1, T)
        positions = torch.arange(start, end, device=self.device)[None, :]  # (1, T)
        tables = self.block_tables([seq.block_table], end)  # (1, W)
        write = self.slots(tables, positions)  # (1, T)
        keys = torch.arange(end, device=self.device)  # S = end: the prefix and this chunk
        mask = (keys[None, :] <= positions[0, :, None])[None, None]  # (1, 1, T, S): causal, prefix included
        view = self.cache.view(write, tables)
        last_only = not seq.wants_prompt_logprobs
        return self.model(tokens, positions, mask, view, write, last_only=last_only)[0]  # (1, V) or (T, V)

    def block_tables(self, tables: list[list[int]], S: int) -> torch.Tensor:
        """(B, W) the blocks holding each row's tokens 0..S-1, W = ceil(S / bs); short rows padded with block 0."""
        width = -(-S // self.cache.block_size)
        rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        return torch.tensor(rows, device=self.device)

    def slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) pool slot of the token at each position: its block's first slot + its offset in the block."""
        bs = self.cache.block_size
        return tables.gather(1, positions // bs) * bs + positions % bs
