"""Attention over a packed step (batch.py): each row's new tokens over its own keys in the pool.

The model runs one forward over the step's N tokens as a batch of one, (1, N), and hands each layer's
q (1, H, N, D), k, v (1, K, N, D) to the cache's `attend` (model/qwen3.py). `PackedView` writes k, v
into their slots of the pool, then attends row by row, by one of three routes, all pure PyTorch:

  - "paged" (the CPU's): the leading decode rows together, as one (B, H, 1, D) batch read in place
    (paged_attention.py) or gathered; where it reads in place, each query of a speculative row (a newest
    token and its proposals) joins that batch as a one-query row of its own (`speculative_queries`); each
    other row (a prompt chunk, or a speculative row where the decodes are gathered) alone: its blocks gathered and
    attended with SDPA under its causal mask, as a prefill of that chunk alone would, with its exact queries
    and keys (`prompt_row` says why they are not padded to buckets); the tokens of a step's pad row (batch.step_padded) attend nothing and get zeros;
  - "flex" (a GPU's): a decode step's rows in one FlexAttention call reading the pool in place (flex_paged.py),
    compiled for the step's static shapes (a decode bucket's: model_runner.py); a step with prompt rows
    takes the "paged" way, so that no shape that changes with every prompt reaches the compiler;
  - the reference (`reference_inputs`): the whole step as one row whose keys are every row's blocks,
    gathered end to end, under a block-diagonal causal mask. Plain `PagedView` + the model's own SDPA:
    what tests compare against, and what tensor-parallel workers rebuild (they know only `PagedView`).
    Its cost grows with rows x keys of all rows, so it is not the route a step takes.

Shapes: N tokens, R rows, B decode rows, H query / K kv heads, D head_dim, W blocks per row,
S keys of one row, T a prompt row's queries, bs block_size.
"""

import torch
import torch.nn.functional as F

from qwen3_scratch.model.qwen3 import one_query_attention

from . import paged_attention
from .batch import PackedBatch
from .flex_paged import FlexPagedAttention
from .paged_cache import PagedKVCache, PagedView

ROUTES = ("paged", "flex")


def dense_attention(q, k, v, mask):
    """The model's own attention for q (B, H, T, D) over gathered k, v (B, K, S, D): what Attention.attend runs."""
    if q.shape[2] == 1 and q.device.type == "cpu" and q.dtype != torch.float32:
        return one_query_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class PackedView(PagedView):
    """The pool as one packed forward sees it: writes each token's key/value, attends row by row."""

    def __init__(self, cache: PagedKVCache, batch: PackedBatch, route: str = "paged", compile_flex: bool | None = None,
                 shapes: int = 16):  # fmt: skip
        """compile_flex, shapes: FlexPagedAttention's compile and shapes (the flex route's decode steps)."""
        super().__init__(cache, batch.slots, batch.tables)
        self.batch, self.route = batch, route
        bs = cache.block_size
        self.flex = None
        if route == "flex" and batch.num_decodes == batch.num_rows:
            self.flex = FlexPagedAttention(batch, bs, cache.num_blocks + 1, compile=compile_flex, shapes=shapes)
            return
        # Made once per forward, used by every layer: the decode queries' tables, table width and valid slots,
        # and each prompt row's causal mask and table (prompt_row).
        B = batch.num_decodes
        spec = range(B, B + (batch.num_speculative if cache.in_place else 0))  # rows whose queries join the decodes
        rows = list(range(B)) + [r for r in spec for _ in range(batch.query_lens[r])]  # one per query
        ends = batch.ends[:B] + [batch.starts[r] + t + 1 for r in spec for t in range(batch.query_lens[r])]
        self.decode_tables, self.query_ends = batch.tables[:B], None  # refresh reads the batch's context_lens
        if spec:  # see speculative_queries
            self.decode_tables, self.query_ends = self.speculative_queries(rows, ends)
        self.num_queries = len(rows)
        whole = not spec and B == batch.num_rows  # a decode step: its tables' width (a CUDA graph's, fixed)
        self.decode_width = batch.tables.shape[1] if whole else -(-max(ends, default=1) // bs)
        self.refresh()
        self.prompt_rows, offset = [], self.num_queries
        for r in range(spec.stop, batch.num_real):
            self.prompt_rows.append(self.prompt_row(r, offset))
            offset += batch.query_lens[r]
        self.num_pad_tokens = batch.num_tokens - offset  # step_padded's pad row, if any

    def speculative_queries(self, rows: list[int], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-query rows of a step with speculative rows: the decodes, then one for each query of each
        speculative row (its newest token and each proposal), given as the batch row each reads (`rows`) and the
        keys it attends (`ends`, its position + 1) -> (Q, W) block tables and (Q,) ends, as tensors.

        A query at position p of a speculative row attends its row's keys 0..p, exactly what that token attends
        when it is decoded alone; so each runs as a decode row of its own, all in the step's one in-place call,
        with the same kernel and maths as a step without speculation. As rows of their own (SDPA over the
        row's gathered blocks, one call per row and layer), 16 speculating rows made a step of the tiny model
        ~3x a plain one (docs/performance.md, "Speculation in the engine on the AMD EPYC")."""
        device = self.batch.tables.device
        return self.batch.tables[torch.tensor(rows, device=device)], torch.tensor(ends, device=device)

    def prompt_row(self, r: int, offset: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(offset, T, causal mask (1, 1, T, S), block table (1, ceil(S/bs))) of prompt row r: its T queries over
        its S keys, exactly. Not padded to buckets, unlike the step's tokens: SDPA's CPU kernel sums a row's
        keys in vector lanes, so masked pad keys (or more queries, at some sizes) change the last bit of every
        output, and the engine's greedy tokens would drift from the simple loop's; these (T, S) shapes cost
        SDPA ~0.1 MiB each where a linear's cost oneDNN ~0.75 (docs/performance.md, "Flat memory")."""
        batch, bs = self.batch, self.cache.block_size
        n, device = batch.query_lens[r], batch.input_ids.device
        S = batch.starts[r] + n
        positions = batch.positions[0, offset : offset + n]
        keys = torch.arange(S, device=device)
        mask = (keys[None, :] <= positions[:, None])[None, None]  # (1, 1, T, S)
        return offset, n, mask, batch.tables[r : r + 1, : -(-S // bs)]

    def refresh(self) -> None:
        """Recompute what depends on the batch's tensors, from them alone (no host sync): a CUDA graph
        captures this with the forward and replays both over its static buffers (cuda_graphs.py)."""
        if self.flex is not None:
            self.flex.refresh(self.batch)
            return
        B = self.batch.num_decodes
        ends = self.batch.context_lens[:B] if self.query_ends is None else self.query_ends  # (B,), (Q,)
        slots = torch.arange(self.decode_width * self.cache.block_size, device=self.batch.input_ids.device)
        self.decode_valid = slots[None, :] < ends[:, None]  # (B, W*bs)

    def attend(self, layer: int, q, k, v, mask=None) -> torch.Tensor:
        """Write k, v (1, K, N, D); return every token's attention over its row's keys, (1, H, N, D)."""
        self.write(layer, k, v)
        if self.flex is not None:
            return self.flex(q, self.cache.keys[layer], self.cache.values[layer])
        B = self.num_queries
        parts = [self._decodes(layer, q[:, :, :B])] if B else []
        for offset, n, mask, table in self.prompt_rows:
            parts.append(self._row(layer, q[:, :, offset : offset + n], mask, table))
        if self.num_pad_tokens:
            parts.append(q.new_zeros(*q.shape[:2], self.num_pad_tokens, q.shape[3]))  # (1, H, pad, D), dropped
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def _decodes(self, layer: int, q) -> torch.Tensor:
        """q (1, H, B, D) of the B decode rows -> (1, H, B, D), in one batch over their tables."""
        q = q[0].transpose(0, 1)[:, :, None]  # (B, H, 1, D)
        B, W, bs = q.shape[0], self.decode_width, self.cache.block_size
        tables = self.decode_tables[:, :W]
        if self.cache.in_place:
            valid = self.decode_valid.view(B, W, bs)
            y = paged_attention.attend_in_place(q, self.cache.key_blocks[layer], self.cache.value_blocks[layer],
                                                tables, valid)  # fmt: skip
        else:
            keys, values = self._gather(self.cache.keys[layer], tables), self._gather(self.cache.values[layer], tables)
            y = dense_attention(q, keys, values, self.decode_valid[:, None, None, :])
        return y[:, :, 0].transpose(0, 1)[None]  # (B, H, 1, D) -> (1, H, B, D)

    def _row(self, layer: int, q, mask, table) -> torch.Tensor:
        """One prompt row: q (1, H, T, D) over its S keys (the mask's last dim), gathered, causally."""
        S = mask.shape[-1]
        keys = self._gather(self.cache.keys[layer], table)[:, :, :S]  # (1, K, S, D)
        values = self._gather(self.cache.values[layer], table)[:, :, :S]
        return dense_attention(q, keys, values, mask)

    def _gather(self, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Whole blocks of tables (B, W) out of pool (K, slots, D) -> (B, K, W*bs, D), contiguous in (K, B) order."""
        K, _, D = pool.shape
        B, W = tables.shape
        bs = self.cache.block_size
        blocks = pool.view(K, -1, bs * D)  # (K, blocks, bs*D)
        return torch.index_select(blocks, 1, tables.reshape(B * W)).view(K, B, W * bs, D).transpose(0, 1)


def reference_inputs(batch: PackedBatch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step as one gathered row: (1, sum W) every row's blocks end to end, and the (1, 1, N, sum W*bs)
    mask that lets each token see its own row's keys up to its position, and nothing of other rows."""
    device = batch.input_ids.device
    widths = [-(-end // block_size) for end in batch.ends]
    blocks = torch.cat([batch.tables[r, :w] for r, w in enumerate(widths)])[None]  # (1, sum W)
    key_row = torch.repeat_interleave(torch.arange(batch.num_rows, device=device),
                                      torch.tensor(widths, device=device) * block_size)  # fmt: skip
    key_pos = torch.cat([torch.arange(w * block_size, device=device) for w in widths])  # each key's position
    token_row = torch.repeat_interleave(torch.arange(batch.num_rows, device=device),
                                        torch.tensor(batch.query_lens, device=device))  # fmt: skip
    positions = batch.positions[0]
    mask = (token_row[:, None] == key_row[None, :]) & (key_pos[None, :] <= positions[:, None])  # (N, S)
    return blocks, mask[None, None]
