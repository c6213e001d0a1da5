"""Ranks 1..N-1: wait for rank 0's next message, do what it says, in the same order as every other rank.

Messages (group.py broadcasts them on the control group):
    ("load", key, folder, device, dtype, optimize, quantize, group_size)   load this rank's shard (loading.py)
    ("forward", Step)                                          run one forward of model `key`
    ("stop",)                                                  leave the groups and exit 0
A Step carries what rank 0's forward was called with, every default already resolved on rank 0, and
a description of the cache it used (`CacheSpec`): a worker keeps its own mirror of each cache, holding
its own kv heads, made on first sight and dropped when rank 0's cache is garbage-collected. The mirror
is built from the cache's own class (a paged pool comes as the engine's class, unpickled by name), so
this layer names no class above it.

A worker that fails prints one line and exits 1; rank 0's next collective then fails and names it.
"""

import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from qwen3_scratch.model.kv_cache import KVCache

from .loading import load_shard
from .ranks import init_groups, loaded, rank_device


@dataclass
class CacheSpec:
    """A cache as the workers rebuild it: a static KVCache, or a paged pool with this forward's view."""

    key: tuple  # ("static", serial) or ("paged", n): names the cache across steps
    kind: str  # "static" or "paged"
    shape: tuple  # static: (batch, max_len); paged: (num_blocks, block_size)
    pool_class: type | None = None  # paged: the pool's class, whose .view(write, read) the model reads through
    write_slots: torch.Tensor | None = None
    read_blocks: torch.Tensor | None = None
    copied_from: tuple | None = None  # static: (key, n) when it began as a copy of another's first n slots


@dataclass
class Step:
    """One forward: the arguments of Qwen3.forward, resolved, plus what the workers need besides."""

    key: int  # which loaded model
    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor | None  # (B, 1, T, S) or None (causal)
    cache: CacheSpec | None
    cache_slots: torch.Tensor | None
    last_only: bool
    rope_positions: int  # rank 0's RoPE table length, so every rank's covers the same positions
    freed: list = field(default_factory=list)  # cache keys rank 0 no longer holds
    logits_at: torch.Tensor | None = None  # (M,) the tokens whose logits rank 0 asked for (a packed engine step)


def mirror(spec: CacheSpec | None, caches: dict, model, device):
    """This rank's cache for `spec`, made on first sight (in its shard's shapes), as the model reads it."""
    if spec is None:
        return None
    cache = caches.get(spec.key)
    if cache is None:
        config, dtype = model.config, model.activation_dtype
        if spec.kind == "static":
            cache = KVCache(config, *spec.shape, device, dtype)
            if spec.copied_from is not None:
                source, n = spec.copied_from
                cache.copy_prefix(caches[source], n)
        else:
            cache = spec.pool_class(config, *spec.shape, device, dtype)
        caches[spec.key] = cache
    if spec.kind == "paged":
        return cache.view(spec.write_slots.to(device), spec.read_blocks.to(device))
    return cache


def run_step(models: dict, caches: dict, step: Step, device) -> None:
    model = models[step.key]
    model.reserve_positions(step.rope_positions)
    cache = mirror(step.cache, caches, model, device)
    for key in step.freed:  # after making new caches: a new one may be a copy of a freed one
        caches.pop(key, None)
    move = (lambda t: None if t is None else t.to(device))  # fmt: skip
    model(move(step.input_ids), move(step.position_ids), move(step.mask), cache, move(step.cache_slots),
          last_only=step.last_only, logits_at=move(step.logits_at))  # fmt: skip  # the logits are rank 0's; here only the collectives matter


def worker_main(rank, world, init_method, device, timeout_s, threads=None, local_rank=None) -> None:
    """Serve rank 0 until it says stop (then return) or dies (then exit at once)."""
    if threads:
        torch.set_num_threads(threads)
    own = rank_device(device, rank if local_rank is None else local_rank)
    if own.type == "cuda":
        torch.cuda.set_device(own)
    control, loading = init_groups(rank, world, init_method, own.type, timeout_s)
    models, caches = {}, {}
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control)
        except Exception:
            os._exit(0)  # rank 0 is gone: nothing to report to, nothing to finish
        message = box[0]
        try:
            if message[0] == "stop":
                break
            if message[0] == "load":
                key, folder, dev, dtype, optimize, quantize, group_size = message[1:]
                models[key] = load_shard(folder, rank, world, own, dtype, optimize, quantize, group_size)
                loaded(loading)
            elif message[0] == "forward":
                with torch.no_grad():
                    run_step(models, caches, message[1], own)
        except Exception as error:
            print(f"qwen3 tensor-parallel rank {rank}: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
            os._exit(1)
    dist.destroy_process_group()
