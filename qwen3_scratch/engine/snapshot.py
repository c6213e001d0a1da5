"""A picture of the engine at one instant, as plain data: who runs, who waits, what each KV block holds.

For people watching the engine work (the server's engine view): nothing here changes the engine, and
nothing in the engine reads it. It walks the scheduler's queues and the block manager's blocks, so it
must run where the engine's state is still: on the engine's own thread, between two steps (the
server's AsyncEngine asks for it through its inbox). It costs one pass over the pool: O(num_blocks).

A block is in one of four states, one character each in `pool["states"]` (index = block id):
  "." free: no sequence holds it and it holds nothing worth keeping;
  "c" cached: no sequence holds it, but it is a sealed full block of some earlier prompt, kept on the
      free list with its hash, so a request with the same prefix revives it instead of recomputing;
  "u" in use by one sequence;
  "s" shared: in the block tables of two or more sequences (a common prefix, counted once).
"""

from .block_manager import NO_HASH, BlockManager
from .scheduler import Sequence

FREE, CACHED, USED, SHARED = ".", "c", "u", "s"


def block_state(ref_count: int, hashed: bool) -> str:
    if ref_count > 1:
        return SHARED
    if ref_count == 1:
        return USED
    return CACHED if hashed else FREE


def pool(blocks: BlockManager) -> dict:
    """The pool's blocks, one state character each, and how many are in each state."""
    states = "".join(block_state(b.ref_count, b.hash is not NO_HASH) for b in blocks.blocks)
    return {
        "num_blocks": blocks.num_blocks,
        "block_size": blocks.block_size,
        "states": states,
        "free": states.count(FREE),
        "cached": states.count(CACHED),
        "used": states.count(USED),
        "shared": states.count(SHARED),
    }


def sequence(seq: Sequence) -> dict:
    return {
        "id": seq.request_id,
        "index": seq.index,  # which of its request's n choices
        "prompt_tokens": seq.num_prompt_tokens,
        "output_tokens": seq.num_output_tokens,
        "max_tokens": seq.max_tokens,
        "computed_tokens": seq.num_computed,  # keys/values in the cache (a prompt in chunks: growing)
        "cached_tokens": seq.num_cached_prompt,  # of the prompt, served from the prefix cache
        "preemptions": seq.num_preemptions,
        "blocks": list(seq.block_table),
    }


def snapshot(engine) -> dict:
    """The engine (an LLMEngine) now: its running and waiting sequences in order, and its pool.
    Engine thread only (see the module's docstring)."""
    scheduler, blocks = engine.scheduler, engine.blocks
    return {
        "running": [sequence(s) for s in scheduler.running],
        "waiting": [sequence(s) for s in scheduler.waiting],
        "pool": pool(blocks),
        "context": engine.context,
        "prefix_cache_hit_rate": blocks.prefix_hit_rate,
        "preemptions": engine.num_preemptions,
        "aborted": engine.num_aborted,
    }
