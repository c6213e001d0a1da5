"""One engine step as one forward: every row's new tokens flattened into a single (1, N) sequence (varlen).

A *row* is one sequence's chunk of new tokens at positions start..end-1, attending over its own cached
keys 0..start-1 (read through its block table) and, causally, over itself. A decode is a row of one
token; a prompt chunk a row of T; a speculative step (draft tokens checked at once) a row of k+1. Rows
of different lengths cannot share a (B, T) tensor without padding every row to the longest, so the
step's tokens are laid end to end instead, as vLLM does:

    tokens    [ d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 ]     (1, N), N = sum of the rows' lengths
    rows      0    1    2    3                  4               query_starts = [0, 1, 2, 3, 8, 11]

Every linear layer, norm and the MLP are per token, so they run once over all N tokens; only attention
needs the rows, and it reads them from here (packed_view.py). Rows of one token (decodes) come first, so
that attention can run them as one batch.

Padding: every step is padded up to a bucket (buckets.py) so that only a few shapes ever run. A decode step
gets pad rows up to a bucket of rows (decode_padded, the GPU graphs' buckets); any other step one pad row
of as many tokens as bring N up to a bucket, and pad entries of logits_at up to a bucket of M (step_padded).
A pad token holds token 0 at position 0, writes its key/value into the pool's scratch block (paged_cache.py:
never handed to a sequence) and attends over that slot alone; its logits are cut off. Nothing it computes
reaches a real row: every op outside attention is per token, and attention is per row.

Shapes: N tokens, R rows, W blocks per row (the widest row's, narrower rows padded), bs block_size.
"""

from dataclasses import dataclass, replace

import torch

from .scheduler import Chunk
from .transfer import to_device


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (1, N)
    positions: torch.Tensor  # (1, N) each token's position in its own sequence (RoPE, causality)
    slots: torch.Tensor  # (N,) each token's pool slot, where its key/value is written
    tables: torch.Tensor  # (R, W) each row's block table, padded with the scratch block
    context_lens: torch.Tensor  # (R,) keys each row attends: its cached prefix and its new tokens
    query_lens: list[int]  # tokens per row (host copies: attention loops over prompt rows)
    starts: list[int]  # position of each row's first new token
    logits_at: torch.Tensor  # (M,) the token indices whose logits the step needs
    num_decodes: int  # leading rows of one token each
    num_real: int  # rows before the padding (decode_padded)
    num_speculative: int = 0  # rows right after the decodes that carry proposals (a newest token and its k)

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def ends(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.query_lens)]


def pack(chunks: list[Chunk], block_size: int, scratch_block: int, device, wants_all: set[int] = frozenset(),
         width: int | None = None) -> PackedBatch:  # fmt: skip
    """The rows of chunks (decodes first) flattened. wants_all: ids of sequences that need the logits of every
    new token (prompt logprobs), the others get their last token's. width: pad the tables to this many blocks.

    A decode whose newest token is still on the device (`Sequence.pending`: drawn by the step before, not read
    back yet) gets it there, copied into its slot of input_ids. Every host list goes to the device as one
    tensor (transfer.to_device), so packing never waits for a step still running."""
    ids, positions, slots, logits_at, tables, pending = [], [], [], [], [], []
    for chunk in chunks:
        seq, start, end = chunk.seq, chunk.start, chunk.end + len(chunk.proposed)
        table = seq.block_table
        first = len(ids)
        ids += chunk.new_ids
        if seq.pending is not None and chunk.end == seq.num_tokens:  # its newest token: on the device
            pending.append((len(ids), seq.pending))
            ids.append(0)
        positions += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        # a speculative row needs the logits after its newest token and after each proposal
        last_few = range(len(ids) - 1 - len(chunk.proposed), len(ids))
        logits_at += range(first, len(ids)) if id(seq) in wants_all else last_few
        tables.append(table[: -(-end // block_size)])
    W = max(width or 0, max(len(t) for t in tables))
    R, N = len(chunks), len(ids)
    lens = [c.end + len(c.proposed) - c.start for c in chunks]
    num_decodes = next((i for i, n in enumerate(lens) if n != 1), len(lens))
    num_speculative = sum(1 for c in chunks if c.proposed)
    speculative = chunks[num_decodes : num_decodes + num_speculative]
    assert all(c.proposed for c in speculative), "speculative rows come right after the decodes"
    flat = ids + positions + slots + [b for t in tables for b in t + [scratch_block] * (W - len(t))]
    flat += [c.end + len(c.proposed) for c in chunks] + logits_at
    flat += [at for at, _ in pending] + [row for _, (_, row) in pending]
    sizes = [N, N, N, R * W, R, len(logits_at), len(pending), len(pending)]
    on_device = to_device(flat, device).split(sizes)
    input_ids, positions, slots, tables, context_lens, logits_at, pending_at, pending_rows = on_device
    if pending:  # all drawn by the one step before (engine.py reads a step back before it keeps the next)
        tokens = pending[0][1][0]
        assert all(source is tokens for _, (source, _) in pending), "pending tokens come from one step"
        input_ids.index_copy_(0, pending_at, tokens.index_select(0, pending_rows))
    return PackedBatch(input_ids[None], positions[None], slots, tables.view(R, W), context_lens, lens,
                       [c.start for c in chunks], logits_at, num_decodes, R, num_speculative)  # fmt: skip


def decode_padded(batch: PackedBatch, rows: int, scratch_block: int, block_size: int) -> PackedBatch:
    """A decode-only batch padded with rows that touch only the scratch block, up to `rows` rows."""
    pad = rows - batch.num_rows
    if pad <= 0:
        return batch
    assert batch.num_decodes == batch.num_rows, "only decode steps are padded"
    device = batch.input_ids.device
    zeros = torch.zeros(1, pad, dtype=torch.long, device=device)
    scratch = torch.full((pad,), scratch_block * block_size, dtype=torch.long, device=device)
    tables = torch.full((pad, batch.tables.shape[1]), scratch_block, dtype=torch.long, device=device)
    return PackedBatch(
        torch.cat([batch.input_ids, zeros], 1), torch.cat([batch.positions, zeros], 1),
        torch.cat([batch.slots, scratch]), torch.cat([batch.tables, tables]),
        torch.cat([batch.context_lens, torch.ones(pad, dtype=torch.long, device=device)]),
        batch.query_lens + [1] * pad, batch.starts + [0] * pad,
        torch.arange(rows, device=device), rows, batch.num_real,
    )  # fmt: skip


def step_padded(batch: PackedBatch, tokens: int, logits: int, scratch_block: int, block_size: int) -> PackedBatch:
    """batch with a pad row of tokens - N tokens after its rows (all at position 0, writing the scratch block's
    first slot), and logits_at repeated at its last entry up to `logits` entries (their logits are cut off)."""
    pad, device = tokens - batch.num_tokens, batch.input_ids.device
    extra = batch.logits_at[-1:].expand(logits - len(batch.logits_at))
    logits_at = torch.cat([batch.logits_at, extra])
    if pad <= 0:
        return replace(batch, logits_at=logits_at)
    zeros = torch.zeros(1, pad, dtype=torch.long, device=device)
    scratch = torch.full((pad,), scratch_block * block_size, dtype=torch.long, device=device)
    table = torch.full((1, batch.tables.shape[1]), scratch_block, dtype=torch.long, device=device)
    return PackedBatch(
        torch.cat([batch.input_ids, zeros], 1), torch.cat([batch.positions, zeros], 1),
        torch.cat([batch.slots, scratch]), torch.cat([batch.tables, table]),
        torch.cat([batch.context_lens, torch.ones(1, dtype=torch.long, device=device)]),
        batch.query_lens + [pad], batch.starts + [0], logits_at, batch.num_decodes, batch.num_real, batch.num_speculative,
    )  # fmt: skip
