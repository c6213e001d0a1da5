"""The paged KV cache: one preallocated pool of fixed-size blocks, read through block tables.

The static cache (model/kv_cache.py) gives each row of a batch its own contiguous run of slots, sized for
the longest generation up front. A server does not know its batch in advance: requests come and go,
and their lengths differ by 100x. So memory is cut into blocks of `block_size` token slots, shared
by all requests; a request holds a list of blocks (its block table, block_manager.py) and grows by
one block at a time. Nothing is reserved for tokens that are never generated, and a block of a
shared prefix can sit in several tables at once (prefix caching).

The model does not change. Its attention calls `cache.update(layer, k, v, slots)` and attends over
the first S = mask.shape[-1] keys returned, or, when the cache has an `attend` method, hands it the
queries and lets it attend. Two views of the pool serve those two calls:
  - `PagedView` writes the new keys/values into their slots of the pool, then *gathers* each row's
    blocks, in table order, into a dense (B, K, S, D) tensor; the mask hides the padding. It is the
    reference route, and what tensor-parallel workers read through.
  - `PackedView` (packed_view.py, every engine step) writes the same way, then attends row by row:
    decode rows over their blocks where they lie in the pool (paged_attention.py on a CPU, FlexAttention,
    flex_paged.py, on a GPU), prompt rows over their gathered blocks (CPU) or in place (GPU).

What the gather costs against a contiguous cache: attention over a contiguous cache reads each cached
key/value once; the gather reads it, writes a dense copy, and attention reads the copy: about 3x the
memory traffic of the attention's own reads, per layer per step. For a prompt chunk of T tokens that
is small beside the chunk's own T-row products; for a decode batch it is not: at 16 rows x 512 tokens
(0.6B shapes, bf16, CPU) a paged decode step that gathers takes 3.6-5.0x the contiguous one, and one
that attends in place 1.05-1.10x, which is why decode batches attend in place (docs/performance.md).

Slots are numbered block_id * block_size + offset. The pool is stored head-major, (L, K, N, D): a write
indexes slots (index_copy_), and a gather picks whole blocks of a (K, num_blocks, block_size * D) view with
one index_select, so each kv head's keys for a row come out as one contiguous (S, D) matrix, batched in
(K, B) order. That order matters: batched matmuls over a strided gather (rows K * D apart) ran 8x slower
than over contiguous keys on a CPU, and one_query_attention (model/qwen3.py) reads (K, B)-ordered keys as they are.

Shapes: L layers, N pool slots (num_blocks x block_size), K kv heads, D head_dim,
B rows, T new tokens per row, S keys attended per row.
"""

import math
import mmap

import torch

from qwen3_scratch.model.config import Qwen3Config

from . import paged_attention


class PagedKVCache:
    """The pool itself: keys and values for every slot of every block, allocated once."""

    def __init__(self, config: Qwen3Config, num_blocks: int, block_size: int, device=None, dtype=torch.float32,
                 in_place: bool | None = None):  # fmt: skip
        """in_place: decode batches attend in the pool (None: wherever paged_attention supports it)."""
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        # One block more than the block manager hands out: the scratch block, where the pad rows of a padded
        # decode batch (batch.py) write and read, so that padding never touches a sequence's keys.
        self.scratch_block = num_blocks
        K, D = config.num_key_value_heads, config.head_dim
        shape = (config.num_hidden_layers, K, (num_blocks + 1) * block_size, D)
        self.keys, self.values = zeroed(shape, device, dtype), zeroed(shape, device, dtype)  # (L, K, N, D)
        # Each layer's pool seen as blocks, (K, num_blocks + 1, block_size, D): views made once, not per step.
        self.key_blocks = [layer.view(K, num_blocks + 1, block_size, D) for layer in self.keys]
        self.value_blocks = [layer.view(K, num_blocks + 1, block_size, D) for layer in self.values]
        self._in_place = in_place

    @property
    def in_place(self) -> bool:
        """Whether decode batches attend in the pool. Left to paged_attention, it is decided at the first decode
        step, not here: deciding builds the kernel (seconds, with dynamo and inductor
        imported), which kept a server's /health waiting ~5 s on every start."""
        if self._in_place is None:
            self._in_place = paged_attention.supported(self.config, self.keys.device, self.keys.dtype)
        return self._in_place

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def view(self, write_slots: torch.Tensor, read_blocks: torch.Tensor) -> "PagedView":
        """The gathering view: the reference route, and what tensor-parallel workers read through."""
        return PagedView(self, write_slots, read_blocks)


def zeroed(shape: tuple, device, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros; on a CPU over an anonymous mapping, whose pages the OS zeroes when first touched. Writing
    the zeros of a 1 GiB pool took ~0.5 s of a server's start, for slots most of which a start never uses."""
    if torch.device(device or "cpu").type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)  # the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


class PagedView:
    """One forward's window on the pool, in the interface model/qwen3.py's attention expects from a cache.

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
        self.write(layer, k, v)
        return self._gather(self.cache.keys[layer]), self._gather(self.cache.values[layer])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, K, T, D) into their slots of the pool."""
        B, K, T, D = k.shape
        flat = self.write_slots.reshape(B * T)
        # (B, K, T, D) -> (K, B, T, D) -> (K, B*T, D): one column per token, in the pool's head-major layout
        self.cache.keys[layer].index_copy_(1, flat, k.transpose(0, 1).reshape(K, B * T, D))
        self.cache.values[layer].index_copy_(1, flat, v.transpose(0, 1).reshape(K, B * T, D))

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        # Whole blocks, not single slots: one index per block_size tokens, each a contiguous run.
        K, _, D = pool.shape
        bs = self.cache.block_size
        B, W = self.read_blocks.shape
        blocks = pool.view(K, -1, bs * D)  # (K, num_blocks, bs*D)
        rows = torch.index_select(blocks, 1, self.read_blocks.reshape(B * W)).view(K, B, W * bs, D)
        return rows.transpose(0, 1)  # (B, K, S, D) as a view: contiguous in (K, B) order
