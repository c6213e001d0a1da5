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

_compiled = {}  # device type -> flex_attention compiled for static shapes


def kernel_options(query_block: int, block_size: int) -> dict:
    """The Triton template's tiles: one mask block each. Inductor skips every tile config that does not divide
    the mask's blocks, and its defaults do not divide 16 x 16 (an H100's bf16 default is 128 x 64; the decode
    kernel's BLOCK_M is the next power of two of queries x GQA group): with no config left it raised
    NoValidChoicesError, the first H100 run's failure. vLLM's direct-build FlexAttention passes the same."""
    return {"BLOCK_M": query_block, "BLOCK_N": block_size, "FORCE_USE_FLEX_ATTENTION": True}


def check_block_sizes(query_block: int, block_size: int) -> None:
    """Triton's tl.dot needs tiles of at least 16, powers of two: a block size that cannot tile raises here,
    before anything compiles (the runner then falls back to the gathered route, model_runner.py)."""
    for name, n in (("query block", query_block), ("KV block_size", block_size)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"FlexAttention on a GPU needs a {name} that is a power of two >= 16, not {n}")


def compiled_flex(device: torch.device, shapes: int = 16):
    """flex_attention compiled for static shapes (`dynamic=False`): the route runs it only on decode buckets,
    whose shapes are fixed (model_runner.py), so each bucket compiles once and no symbolic shape reaches
    inductor's template. dynamo keeps one entry per shape: its recompile limit is raised to `shapes`."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes)
    if device.type not in _compiled:
        _compiled[device.type] = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled[device.type]


class FlexPagedAttention:
    """Made once per forward shape; `refresh(batch)` rewrites its tensors in place from the batch's tensors
    (no host sync, fixed addresses: a CUDA graph replays it over static buffers); called once per layer."""

    def __init__(self, batch: PackedBatch, block_size: int, num_pool_blocks: int, query_block: int = 16,
                 compile: bool | None = None, shapes: int = 16):  # fmt: skip
        """compile: flex_attention compiled for this batch's static shapes (default: on a GPU; a CPU runs it
        eagerly, densely, unless told: inductor compiles it to C++ there, which is how the CPU tests check
        the compiled path); shapes: how many distinct shapes the caller will run (dynamo's limit)."""
        device = batch.input_ids.device
        compile = device.type == "cuda" if compile is None else compile
        if device.type == "cuda":
            check_block_sizes(query_block, block_size)
        self.attention = compiled_flex(device, shapes) if compile else flex_attention
        self.options = kernel_options(query_block, block_size)
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
        # inductor's CPU template wants a column per pool block; the GPU's reads only the first counts of W
        C = W if device.type == "cuda" else max(W, num_pool_blocks)
        self.kv = [torch.zeros(1, 1, *shape, dtype=torch.int32, device=device) for shape in ((nQB,), (nQB, C))] * 2
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
            buffer[..., : value.shape[-1]].copy_(value.view(buffer[..., : value.shape[-1]].shape))

    def mask_mod(self, b, h, q_idx, kv_idx):
        j = self.logical[self.q_row[q_idx], kv_idx // self.bs]  # the kv slot's block, as the row's j-th
        return (j >= 0) & (j * self.bs + kv_idx % self.bs <= self.q_pos[q_idx])

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D) over one layer's pool keys, values (K, slots, D) -> (1, H, N, D)."""
        _, H, N, D = q.shape
        padded = q.new_zeros(1, H, self.q_row.shape[0], D)  # (1, H, Np, D)
        padded[:, :, self.place] = q
        y = self.attention(padded, keys[None], values[None], block_mask=self.block_mask, enable_gqa=True,
                           kernel_options=self.options)  # fmt: skip
        return y[:, :, self.place]
