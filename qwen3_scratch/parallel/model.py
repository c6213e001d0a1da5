"""Rank 0's model: to the simple loops and the engine it is a Qwen3; each forward runs on every rank.

    model = load_parallel_model("weights/Qwen3-32B", 2, device="cuda", dtype=torch.bfloat16)
    logits = model(input_ids)            # (B, T, V): broadcast the step, run rank 0's shard, gather logits

`forward` resolves the defaults Qwen3.forward would (positions, cache slots, the causal mask over the
cache), describes the cache (worker.py keeps a mirror of it on every rank), broadcasts that one Step,
then runs its own shard; the collectives inside the shard's layers meet the workers'. Everything else
(config, device, activation_dtype, reserve_positions, the modules) is rank 0's shard, so the loops
allocate caches of the shard's size: `config` is the shard's (its heads, kv heads and MLP width are per
rank; vocabulary, layers and context are the model's).
"""

import itertools
import weakref
from pathlib import Path

import torch

from qwen3_scratch.checkpoint.weights import check_quantize
from qwen3_scratch.errors import Qwen3Error
from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.kv_cache import KVCache, attention_mask
from qwen3_scratch.model.qwen3 import Qwen3

from .group import ParallelGroup, get_group
from .loading import load_shard, read_checked_entries
from .plan import ParallelError
from .ranks import DEFAULT_TIMEOUT_S, loaded, rank_device
from .worker import CacheSpec, Step

_KEYS = itertools.count()


class TensorParallelQwen3:
    def __init__(self, shard: Qwen3, group: ParallelGroup, key: int):
        self.shard, self.group, self.key = shard, group, key
        self.config: Qwen3Config = shard.config
        self.world = group.world
        self._pools: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()
        self._known: set = set()  # cache keys the workers hold
        self._freed: list = []  # keys of caches garbage-collected here, for the next step to drop

    def __getattr__(self, name):  # device, activation_dtype, lm_head, model, modules(), parameters(), ...
        return getattr(self.shard, name)

    def reserve_positions(self, n: int) -> None:
        self.shard.reserve_positions(n)  # the workers follow through Step.rope_positions

    def hidden_states(self, *args, **kwargs):
        raise ParallelError("tensor parallelism serves generative checkpoints (logits); embeddings run on one device")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def forward(self, input_ids, position_ids=None, mask=None, cache=None, cache_slots=None, last_only=False,
                logits_at=None):  # fmt: skip
        """Qwen3.forward's arguments and result (logits (B, T, V), or (B, 1, V) with last_only), on N ranks."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if position_ids.device.type == "cpu":
            self.shard.reserve_positions(int(position_ids.max()) + 1)
        if cache is not None:
            cache_slots = position_ids[0] if cache_slots is None else cache_slots
            if mask is None:
                mask = attention_mask(cache_slots, cache.key_valid)
        cpu = (lambda t: None if t is None else t.cpu())  # fmt: skip  # rank 0's device is not the workers'
        freed, self._freed = self._freed, []
        step = Step(self.key, cpu(input_ids), cpu(position_ids), cpu(mask), self.cache_spec(cache), cpu(cache_slots),
                    last_only, self.shard.rope_cos.shape[0], freed, cpu(logits_at))  # fmt: skip
        self.group.send(("forward", step))
        try:
            return self.shard(input_ids, position_ids, mask, cache, cache_slots, last_only=last_only, logits_at=logits_at)
        except Exception as error:  # the workers went on into collectives this rank left: no way back in step
            self.group.fail(error, "running a forward")

    def cache_spec(self, cache) -> CacheSpec | None:
        """How the workers rebuild `cache`; the first time, arrange for them to drop it when it goes."""
        if cache is None:
            return None
        if isinstance(cache, KVCache):
            key = ("static", cache.serial)
            spec = CacheSpec(key, "static", (cache.keys.shape[1], cache.max_len))
            if cache.copied_from is not None:
                spec.copied_from = (("static", cache.copied_from[0]), cache.copied_from[1])
            owner = cache
        else:  # the engine's paged view: its pool, and where this forward writes and reads
            pool = cache.cache
            key = self._pools.setdefault(pool, ("paged", next(_KEYS)))
            spec = CacheSpec(key, "paged", (pool.num_blocks, pool.block_size), type(pool),
                             cache.write_slots.cpu(), cache.read_blocks.cpu())  # fmt: skip
            owner = pool
        if key not in self._known:
            self._known.add(key)
            weakref.finalize(owner, self._forget, key)
        return spec

    def _forget(self, key) -> None:
        self._known.discard(key)
        self._freed.append(key)


def load_parallel_model(path, world: int, device="cpu", dtype=torch.float32, optimize=None, quantize=None,
                        quantize_group_size=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelQwen3:  # fmt: skip
    """The checkpoint in `path` split over `world` ranks (rank 0 here, the others spawned), as rank 0's model.

    Everything checkable is checked before any process starts: config.json, the tensors, and whether
    `world` divides the model (one line naming --tensor-parallel-size)."""
    group_size = check_quantize(quantize, quantize_group_size)
    folder = Path(path)
    if not folder.is_dir():
        raise Qwen3Error(f"{folder}: no such checkpoint folder")
    config = Qwen3Config.from_json(folder / "config.json")
    read_checked_entries(folder, config, world)
    group = get_group(world, str(device), timeout_s)
    key = next(_KEYS)
    group.send(("load", key, str(folder), str(device), dtype, optimize, quantize, group_size))
    try:
        shard = load_shard(folder, 0, world, rank_device(str(device), 0), dtype, optimize, quantize, group_size)
        loaded(group.loading)  # every rank holds its shard: the first step finds them all listening
    except RuntimeError as error:  # a collective failed (the layout's warm-up step, loaded): a worker died loading
        group.fail(error, "loading")
    except Exception:
        group.close()
        raise
    return TensorParallelQwen3(shard, group, key)
