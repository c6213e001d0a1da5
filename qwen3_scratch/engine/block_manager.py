"""Who owns which KV block: the free list, block tables, reference counts and the prefix cache.

The paged cache (paged_cache.py) is one preallocated pool of `num_blocks` blocks of `block_size`
token slots each. This module never touches tensors: it hands out block ids. A sequence's *block
table* lists its blocks in order, so token i of the sequence lives in block table[i // block_size]
at offset i % block_size.

Prefix caching. A *full* block is named by a chained hash: hash(previous block's hash, this block's
tokens). Equal hashes mean equal token prefixes up to the block's end, and in a causal model the
keys/values of a token depend only on the tokens before it, so two sequences that share a prefix
can share its blocks. Shared blocks carry a reference count.

Invariants (each one is kept by the one method that changes it):
  - A block with ref_count > 0 belongs to the sequences whose tables list it; it is never in `free`.
  - A block with ref_count == 0 is in `free`, ordered least-recently-used first. It may still hold
    a hash and its keys/values: a later request with the same prefix revives it (a cache hit).
    `allocate_block` evicts from the front, and only then forgets the block's hash.
  - A hash is final only once every slot of the block has been written by a forward pass
    (`seal_full_blocks`, called after the step that wrote them). Before that a block has no hash,
    so nobody can share keys/values that do not exist yet.
  - Hashes are checked against the block's stored tokens on lookup, so a collision is a miss.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

NO_HASH = None


def chain_hash(previous: int | None, tokens: list[int]) -> int:
    """The key of a full block: its own tokens and, through `previous`, every token before them."""
    return hash((previous, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = NO_HASH  # set by seal_full_blocks, cleared on eviction
    token_ids: list[int] = field(default_factory=list)  # the tokens behind `hash`, to rule out collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id, for full sealed blocks (in use or free)
        self.hit_tokens = 0  # prompt tokens served from the prefix cache (metrics)
        self.queried_tokens = 0  # prompt tokens looked up

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup and admission -------------------------------------------------------------

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of token_ids, in order.

        Only blocks that end before the last token count: the last token must go through the model
        anyway (its logits pick the next token), and its slot must be in a block this sequence owns.
        """
        found, previous = [], None
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            tokens = token_ids[start : start + self.block_size]
            previous = chain_hash(previous, tokens)
            block_id = self.cached.get(previous)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def can_allocate(self, token_ids: list[int], reserve: int = 0, use_cache: bool = True) -> bool:
        """Enough free blocks for all of token_ids (cached blocks in use cost nothing), plus `reserve`."""
        hits = self.cached_prefix(token_ids) if use_cache else []
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # they leave the free list
        needed = self.blocks_for(len(token_ids)) - len(hits) + revived
        return needed + reserve <= self.num_free

    def allocate(self, token_ids: list[int], use_cache: bool = True) -> tuple[list[int], int]:
        """A block table for token_ids: cached prefix blocks shared (unless not use_cache), fresh blocks for the rest.

        Returns (block table, number of leading tokens whose keys/values are already cached).
        The caller checked can_allocate.
        """
        table = self.cached_prefix(token_ids) if use_cache else []
        for block_id in table:
            self._take(block_id)
        cached_tokens = len(table) * self.block_size
        self.hit_tokens += cached_tokens
        self.queried_tokens += len(token_ids)
        while len(table) < self.blocks_for(len(token_ids)):
            table.append(self.allocate_block())
        return table, cached_tokens

    def allocate_block(self) -> int:
        """A fresh block, owned by the caller: the least recently used free block, its hash forgotten."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not NO_HASH and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evicted: its keys/values are about to be overwritten
        block.hash, block.token_ids, block.ref_count = NO_HASH, [], 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]  # revived from the free list: a cache hit on a released block
        block.ref_count += 1

    # -- growth, sealing, release ----------------------------------------------------------------

    def ensure_capacity(self, table: list[int], num_tokens: int) -> bool:
        """Grow table to hold num_tokens; False (table unchanged) when the pool has too few free blocks."""
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > self.num_free:
            return False
        for _ in range(missing):
            table.append(self.allocate_block())
        return True

    def seal_full_blocks(self, table: list[int], token_ids: list[int], num_written: int) -> None:
        """Give every block whose slots are all written its final hash, so later requests can share it.

        num_written: how many leading tokens of token_ids have their keys/values in the cache.

        The sealed blocks are a prefix of the table (sealed in order, and a held block keeps its hash), so the
        walk starts after the last sealed one: one or two blocks a step, not the whole table (which was
        0.4 ms a step at 32 rows of ~1,000 tokens, an H100's engine profile).
        """
        full = num_written // self.block_size
        start = full
        while start > 0 and self.blocks[table[start - 1]].hash is NO_HASH:
            start -= 1
        previous = self.blocks[table[start - 1]].hash if start else None
        for index in range(start, full):
            block = self.blocks[table[index]]
            tokens = token_ids[index * self.block_size : (index + 1) * self.block_size]
            if block.hash is NO_HASH:
                block.hash, block.token_ids = chain_hash(previous, tokens), tokens
                # A second copy of an already cached prefix keeps the first copy as the shared one.
                self.cached.setdefault(block.hash, block.block_id)
            previous = block.hash

    def free_table(self, table: list[int]) -> None:
        """Release a sequence's blocks. The tail goes to the free list first, so it is evicted before
        the head: a prompt's first blocks (a shared system prompt) are the likeliest to be asked again."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is NO_HASH:
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)  # nothing to reuse: evict these first
                else:
                    self.free[block_id] = None  # most recently used end
        table.clear()

    @property
    def prefix_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
