"""A packed step's attention as one FlexAttention call over the paged pool, read in place (the GPU route).

vLLM's FlexAttention backend is the model: the pool of one layer, (K, slots, D), is the key sequence as it
lies in memory, and a BlockMask says which of its blocks each query block visits: the blocks of the
query's row, in table order. PyTorch compiles the call to one Triton kernel on a GPU (and to C++ on a
CPU), which loads each visited block where it is: nothing is gathered. Two parts:

  - the *block* level, kv_indices: a query block belongs to one row (rows are padded to whole query
    blocks), so it visits that row's table. Blocks wholly before the block's first query are full (no
    mask evaluated there); the rest, up to its last query's block, are partial;
  - the *token* level, mask_mod(q, kv): kv is a physical slot; its block's place in q's row's table
    (`logical`, -1 where the block is not in the row's table) gives its position, and the query sees it
    if that position is at most its own: causal over the row's prefix and its new tokens.
`logical` holds one entry per (row, pool block): exact wherever a block is, even shared by several rows
(prefix caching), so the mask alone is correct over the whole pool; the block lists only make it fast.
Eager flex_attention (a CPU without compile) evaluates the mask everywhere, which is how the CPU tests check it.

Precision: FlexAttention keeps scores and the softmax in fp32 and rounds the output once; fp32 equals
the gather + SDPA route within rounding (tests/test_engine_step.py). On a GPU it is measured against the
gather by scripts/bench/nano_vllm_workload.py (not here: no GPU on the machine that wrote it).

Shapes: N packed tokens, Np padded to whole query blocks, R rows, H query / K kv heads, D head_dim,
NB pool blocks (the scratch block included), bs block_size (= the kv block size), QB query block size.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .batch import PackedBatch

_compiled = None


def attention_fn(device: torch.device):
    """flex_attention compiled where it pays (a GPU: one Triton kernel), eager elsewhere (dense, for tests)."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:  # a step's token count changes every step: after the first shape, compiled dynamic
        _compiled = torch.compile(flex_attention)
    return _compiled


class FlexPagedAttention:
    """Made once per forward shape; `refresh(batch)` rewrites its tensors in place from the batch's tensors
    (no host sync, fixed addresses: a CUDA graph replays it over static buffers); called once per layer."""

    def __init__(self, batch: PackedBatch, block_size: int, num_pool_blocks: int, query_block: int = 16):
        device = batch.input_ids.device
        self.bs, self.qb, self.num_pool_blocks = block_size, query_block, num_pool_blocks
        padded = [-(-n // query_block) * query_block for n in batch.query_lens]  # each row in whole query blocks
        first = [sum(padded[:r]) for r in range(batch.num_rows)]
        # where each real token goes in the padded sequence, and each padded query's and query block's row
        self.place = torch.tensor([f + i for f, n in zip(first, batch.query_lens) for i in range(n)], device=device)
        rows = torch.arange(batch.num_rows, device=device)
        self.q_row = torch.repeat_interleave(rows, torch.tensor(padded, device=device))  # (Np,)
        self.qb_row = torch.repeat_interleave(rows, torch.tensor([n // query_block for n in padded], device=device))
        nQB, (R, W) = len(self.qb_row), batch.tables.shape
        self.q_pos = torch.zeros(len(self.q_row), dtype=torch.long, device=device)
        self.logical = torch.full((R, num_pool_blocks + 1), -1, dtype=torch.long, device=device)
        self.kv = [torch.zeros(1, 1, *shape, dtype=torch.int32, device=device) for shape in ((nQB,), (nQB, W))] * 2
        self.kv = [t.clone() for t in self.kv]  # partial count, partial blocks, full count, full blocks
        self.refresh(batch)
        self.block_mask = BlockMask.from_kv_blocks(*self.kv, BLOCK_SIZE=(query_block, block_size),
                                                   mask_mod=self.mask_mod, seq_lengths=(nQB * query_block,
                                                   num_pool_blocks * block_size), compute_q_blocks=False)  # fmt: skip

    def refresh(self, batch: PackedBatch) -> None:
        bs = self.bs
        # pad queries take their row's last position: they see real keys, and are dropped after
        self.q_pos.copy_(batch.context_lens[self.q_row] - 1).index_copy_(0, self.place, batch.positions[0])
        # logical: (R, NB+1) index of each pool block in each row's table, -1 where the row does not hold it
        R, W = batch.tables.shape
        index = torch.arange(W, device=batch.tables.device).expand(R, W)
        held = index < -(-batch.context_lens[:, None] // bs)  # (R, W): the table's padding is not held
        columns = torch.where(held, batch.tables, self.num_pool_blocks)  # padding lands in the last column
        self.logical.fill_(-1).scatter_(1, columns, index)
        self.logical[:, -1] = -1
        # the block level: each query block visits its row's blocks, the ones before its first query in full
        qb_pos = self.q_pos.view(-1, self.qb)  # (nQB, QB)
        lo, hi = qb_pos.min(1).values, qb_pos.max(1).values
        tables = batch.tables[self.qb_row]  # (nQB, W)
        full_num = (lo + 1) // bs  # blocks that end at or before the block's first query: no mask needed
        shifted = (torch.arange(W, device=tables.device)[None, :] + full_num[:, None]).clamp(max=W - 1)
        for buffer, value in zip(self.kv, (hi // bs + 1 - full_num, tables.gather(1, shifted), full_num, tables)):
            buffer.copy_(value.view(buffer.shape))

    def mask_mod(self, b, h, q_idx, kv_idx):
        j = self.logical[self.q_row[q_idx], kv_idx // self.bs]  # the kv slot's block, as the row's j-th
        return (j >= 0) & (j * self.bs + kv_idx % self.bs <= self.q_pos[q_idx])

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D) over one layer's pool keys, values (K, slots, D) -> (1, H, N, D)."""
        _, H, N, D = q.shape
        padded = q.new_zeros(1, H, self.q_row.shape[0], D)  # (1, H, Np, D)
        padded[:, :, self.place] = q
        y = attention_fn(q.device)(padded, keys[None], values[None], block_mask=self.block_mask, enable_gqa=True)
        return y[:, :, self.place]
