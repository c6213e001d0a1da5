"""A static, preallocated key/value cache, and the attention masks that go with it.

Without a cache, every new token re-runs the whole sequence through the model. With one, each
layer keeps the keys and values it already computed, and a decode step only runs the new token.

The cache is allocated once for the whole generation (prompt + new tokens), so nothing is
allocated per step and the shapes never change, which is what CUDA graphs need. Each forward
writes its new keys/values at explicit slots and attends over all S slots; the mask hides the
slots that are padding or not yet written.

Shapes: L layers, B batch, K kv heads, S cache slots, D head_dim, T new tokens.
"""

import itertools

import torch

from .config import Qwen3Config

_SERIALS = itertools.count()


class KVCache:
    def __init__(self, config: Qwen3Config, batch_size: int, max_len: int, device=None, dtype=torch.float32):
        # Names this cache, and the cache it began as a copy of, to the mirrors a tensor-parallel run keeps
        # of it on the other ranks (parallel/worker.py); plain numbers, so no cache keeps another alive.
        self.serial, self.copied_from = next(_SERIALS), None
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, K, S, D)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, K, S, D)
        # (B, S): False for a row's left padding; those slots are never attended.
        self.key_valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """Write k, v (B, K, T, D) at `slots` (T,) and return this layer's whole cache, (B, K, S, D) each."""
        # index_copy_ takes the slots as a tensor, so a compiled decode step never sees a new Python int.
        keys, values = self.keys[layer], self.values[layer]  # (B, K, S, D) views, taken once (~3 us each)
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        return keys, values

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def copy_prefix(self, source: "KVCache", n: int) -> None:
        """Take the first n slots of every row from `source` (a cache being outgrown)."""
        self.keys[:, :, :, :n] = source.keys[:, :, :, :n]  # (L, B, K, n, D)
        self.values[:, :, :, :n] = source.values[:, :, :, :n]
        self.copied_from = (source.serial, n)


def attention_mask(query_slots: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, S) bool, True where query t may attend key s: s is not padding and s <= t's slot.

    query_slots (T,): where each new token sits in the sequence; key_valid (B, S).
    This is causal masking aligned to the *end*: a single decode query at slot 40 sees keys 0..40.
    (SDPA's is_causal=True aligns top-left instead: one query would see key 0 only.)
    """
    key_slots = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = key_slots[None, :] <= query_slots[:, None]  # (T, S)
    return (causal[None, :, :] & key_valid[:, None, :]).unsqueeze(1)  # (B, 1, T, S)


# Eager decode attends over the slots written so far, rounded up to a whole block of this many; the
# slots past the newest token are masked (attention_mask's causal part).
ATTEND_BLOCK = 64


def attended_slots(written: int, max_len: int) -> int:
    """How many slots an eager step attends over: `written` rounded up to a whole ATTEND_BLOCK.

    A step still costs what its context costs, but the attention kernels meet a new shape once per
    block instead of at every step: oneDNN builds a kernel for each new shape (~2 ms on a CPU in bf16).
    """
    return min(-(-written // ATTEND_BLOCK) * ATTEND_BLOCK, max_len)


def kv_cache_bytes(config: Qwen3Config, tokens: int, batch_size: int = 1, bytes_per_value: int = 2) -> int:
    """Memory the cache needs: 2 (K and V) x layers x kv heads x head_dim x tokens x batch x bytes."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * tokens * batch_size * bytes_per_value
