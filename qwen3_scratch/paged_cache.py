"""The paged KV cache: one preallocated pool of fixed-size blocks, read through block tables.

The static cache (kv_cache.py) gives each row of a batch its own contiguous run of slots, sized for
the longest generation up front. A server does not know its batch in advance: requests come and go,
and their lengths differ by 100x. So memory is cut into blocks of `block_size` token slots, shared
by all requests; a request holds a list of blocks (its block table, block_manager.py) and grows by
one block at a time. Nothing is reserved for tokens that are never generated, and a block of a
shared prefix can sit in several tables at once (prefix caching).

The model does not change. Its attention calls `cache.update(layer, k, v, slots)` and attends over
the first S = mask.shape[-1] keys returned; `PagedView` implements that `update`: it writes the new
keys/values into their slots of the pool, then *gathers* each row's blocks, in table order, into a
dense (B, K, S, D) tensor. The mask hides the gather's padding.

What the gather costs against a contiguous cache: attention over a contiguous cache reads each cached
key/value once; the gather reads it, writes a dense copy, and attention reads the copy: about 3x the
memory traffic of the attention's own reads, per layer per step. At short contexts decode is
dominated by reading the weights and this is small; it grows with context x batch. Measured on the
0.6B shapes (fp32, CPU; scripts/benchmark_serving.py, docs/performance.md "Serving"): one decode step
of 16 rows at 512 tokens took 1.6x to 2.1x the contiguous cache's (1.8 s against 1.1 s on a busy
2-core machine), since the gather then copies 1.9 GB a step, as much as the weights. A fused paged-attention kernel (vLLM's)
reads the blocks in place; plain PyTorch cannot without one.

Slots are numbered block_id * block_size + offset: the pool is stored slot-major, so a write indexes
slots (index_copy_) and a gather indexes blocks of a (num_blocks, block_size, K, D) view of the same memory.

Shapes: L layers, N pool slots (num_blocks x block_size), K kv heads, D head_dim,
B rows, T new tokens per row, S keys attended per row.
"""

import torch

from .config import Qwen3Config


class PagedKVCache:
    """The pool itself: keys and values for every slot of every block, allocated once."""

    def __init__(self, config: Qwen3Config, num_blocks: int, block_size: int, device=None, dtype=torch.float32):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.num_hidden_layers, num_blocks * block_size, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (L, N, K, D)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (L, N, K, D)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def view(self, write_slots: torch.Tensor, read_blocks: torch.Tensor) -> "PagedView":
        return PagedView(self, write_slots, read_blocks)


class PagedView:
    """One forward's window on the pool, in the interface model.py's attention expects from a cache.

    write_slots (B, T): the pool slot of each new token's key/value.
    read_blocks (B, W): each row's block table, right-padded with any valid block id to the widest
        row; the row's keys are these blocks' slots in order. The forward's mask must hide every slot
        past the row's length (the model attends over the first S = mask.shape[-1] of them).
    """

    def __init__(self, cache: PagedKVCache, write_slots: torch.Tensor, read_blocks: torch.Tensor):
        self.cache, self.write_slots, self.read_blocks = cache, write_slots, read_blocks

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots=None):
        """Write k, v (B, K, T, D) into the pool; return this layer's keys/values per row, (B, K, W*bs, D) each.

        `slots` is whatever the model was handed as cache_slots; the view's write_slots say where
        the tokens go.
        """
        B, K, T, D = k.shape
        flat = self.write_slots.reshape(B * T)
        # (B, K, T, D) -> (B, T, K, D) -> (B*T, K, D): one row per token, in the pool's slot-major layout
        self.cache.keys[layer].index_copy_(0, flat, k.transpose(1, 2).reshape(B * T, K, D))
        self.cache.values[layer].index_copy_(0, flat, v.transpose(1, 2).reshape(B * T, K, D))
        return self._gather(self.cache.keys[layer]), self._gather(self.cache.values[layer])

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        # Index whole blocks, not single slots: one index per block_size tokens, each a contiguous run.
        bs = self.cache.block_size
        blocks = pool.view(-1, bs, *pool.shape[1:])  # (num_blocks, bs, K, D)
        B, W = self.read_blocks.shape
        rows = blocks[self.read_blocks].view(B, W * bs, *pool.shape[1:])  # (B, W*bs, K, D)
        return rows.transpose(1, 2)  # (B, K, W*bs, D)
