"""The generation loop: token ids in, token ids out. It knows nothing about text.

Two loops share one model:
  - full recompute: every step runs the whole sequence again (the reference: simple, obviously right);
  - KV cache: `prefill` runs the prompt once and fills the cache, then each `decode_step` runs only
    the newest token against the cached keys/values.
Both yield one (B,) tensor of token ids per step; finished rows yield -1, and a row whose logits were
not finite yields -2 (sampling.logits.NON_FINITE: the caller must stop). Several prompts run as one
left-padded batch: each row gets its own RoPE positions and a mask that hides its padding, so a
row's tokens are the same as if it ran alone.

Shapes: B batch, T tokens, S cache slots, V vocab.
"""

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from qwen3_scratch.errors import GenerationError
from qwen3_scratch.generation.compile_cache import compile_options
from qwen3_scratch.generation.cuda_graph import can_graph, graphed_decode
from qwen3_scratch.model.kv_cache import KVCache, attended_slots, attention_mask
from qwen3_scratch.model.qwen3 import Qwen3
from qwen3_scratch.sampling.logits import LogitsFilter, all_finite, sample
from qwen3_scratch.sampling.processors import LogitsProcessing, LoopProcessing


@dataclass
class PaddedBatch:
    """Prompts of different lengths, left-padded so every row's newest token is in the last column."""

    ids: torch.Tensor  # (B, T) token ids, pad where valid is False
    valid: torch.Tensor  # (B, T) bool, False on padding
    positions: torch.Tensor  # (B, T) RoPE position of each token, counted from the row's first real token

    @classmethod
    def left_pad(cls, prompts: list[list[int]], pad_id: int, device) -> "PaddedBatch":
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerationError("every prompt needs at least one token (--prompt is empty)")
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
        positions = (valid.cumsum(-1) - 1).clamp(min=0)
        return cls(ids, valid, positions)

    @property
    def padded(self) -> bool:
        return not bool(self.valid.all())


def plan_new_tokens(prompt_len: int, max_new_tokens: int, context: int) -> int:
    """How many tokens fit: a prompt that fills the context is refused, generation stops at the end."""
    if max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt_len >= context:
        raise GenerationError(
            f"the prompt is {prompt_len} tokens but the model's context is {context}; shorten the prompt"
        )
    return min(max_new_tokens, context - prompt_len)


def prefill(model: Qwen3, batch: PaddedBatch, cache: KVCache) -> torch.Tensor:
    """Run the prompt once, filling cache slots 0..T-1; returns the next-token logits (B, V)."""
    T = batch.ids.shape[1]
    cache.key_valid[:, :T] = batch.valid  # padding slots stay hidden for the whole generation
    slots = torch.arange(T, device=batch.ids.device)
    mask = attention_mask(slots, cache.key_valid[:, :T])  # (B, 1, T, T): the prompt sees only itself
    return model(batch.ids, batch.positions, mask, cache, slots, last_only=True)[:, -1]


def decode_step(model: Qwen3, tokens, positions, cache: KVCache, slot, mask=None) -> torch.Tensor:
    """One new token per row: tokens (B, 1) at RoPE positions (B, 1), written at cache slot (1,).

    mask (B, 1, 1, S) limits attention to the first S slots; None attends over the whole cache
    (unwritten slots masked), which keeps every shape fixed for a compiled step.
    """
    return model(tokens, positions, mask, cache, slot, last_only=True)[:, -1]  # (B, V)


class RecomputeLoop:
    """Reference loop: the whole sequence goes through the model at every step."""

    def __init__(self, model: Qwen3, batch: PaddedBatch):
        self.model, self.batch = model, batch
        self.padded = batch.padded  # known once: appended tokens are never padding

    def start(self) -> torch.Tensor:
        ids, valid, positions = self.batch.ids, self.batch.valid, self.batch.positions
        T = ids.shape[1]
        mask = attention_mask(torch.arange(T, device=ids.device), valid) if self.padded else None
        return self.model(ids, positions, mask, last_only=True)[:, -1]  # (B, V)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens (B,) to every row and recompute everything."""
        b = self.batch
        self.batch = PaddedBatch(
            ids=torch.cat([b.ids, tokens[:, None]], dim=1),  # (B, T+1)
            valid=torch.cat([b.valid, torch.ones_like(b.valid[:, :1])], dim=1),
            positions=torch.cat([b.positions, b.positions[:, -1:] + 1], dim=1),
        )
        return self.start()


class CachedLoop:
    """KV-cache loop: prefill the prompt once, then run only the newest token at each step.

    How a step runs: eagerly, op by op (the reference, and the CPU's default); replayed from a CUDA graph
    over a static cache (cuda_graph.py; `cuda_graphs=None` means: where the model is on a GPU); or compiled
    by inductor (`compile`, which captures its own CUDA graphs over its fused kernels).
    """

    def __init__(self, model: Qwen3, batch: PaddedBatch, n_new: int, compile: bool = False,
                 cuda_graphs: bool | None = None):  # fmt: skip
        B, T = batch.ids.shape
        self.model, self.batch = model, batch
        if compile and model.config.num_experts:  # which experts run depends on the data: no fixed graph
            raise GenerationError("--compile is not implemented for MoE (qwen3_moe) models; run without it")
        if cuda_graphs is None:
            cuda_graphs = model.device.type == "cuda" and can_graph(model)
        self.graphed = cuda_graphs and not compile and can_graph(model)
        if compile or self.graphed:  # fixed shapes and addresses: one cache per batch size, reused
            self.cache = static_cache(model, B, T + n_new)
        else:
            self.cache = KVCache(model.config, B, T + n_new, model.device, model.activation_dtype)
        self.decode_step = compiled_decode_step(self.cache, model) if compile else decode_step
        self.compiled = compile
        self.slots = torch.arange(self.cache.max_len, device=model.device)  # made once; steps take views
        self.next_slot = T
        self.positions = batch.positions[:, -1:].clone()  # (B, 1), advanced in place

    def start(self) -> torch.Tensor:
        logits = prefill(self.model, self.batch, self.cache)
        if self.graphed:  # captured here, so that no decode step waits for the GPU
            self.runner = graphed_decode(self.model, self.cache)
            self.runner.prepare(self.slots[self.next_slot : self.next_slot + 1])
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.positions += 1
        slot = self.slots[self.next_slot : self.next_slot + 1]
        self.next_slot += 1
        if self.graphed:  # the step's inputs copied into the graph's buffers, then one replay
            return self.runner(tokens[:, None], self.positions, slot)
        if self.compiled:  # fixed shapes: attend over every slot, the unwritten ones masked
            return self.decode_step(self.model, tokens[:, None], self.positions, self.cache, slot)
        # eager: attend over the slots written so far (in whole blocks), so a step costs what the
        # context costs, not what max_new_tokens reserved
        S = attended_slots(self.next_slot, self.cache.max_len)
        mask = attention_mask(slot, self.cache.key_valid[:, :S])  # (B, 1, 1, S)
        return self.decode_step(self.model, tokens[:, None], self.positions, self.cache, slot, mask)


def generate_tokens(
    model: Qwen3,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: LogitsFilter = LogitsFilter(temperature=0.0),
    eos_ids: list[int] = (),
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    ignore_eos: bool = False,
    pad_id: int = 0,
    compile: bool = False,
    processing: LogitsProcessing | None = None,
    cuda_graphs: bool | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,) on the model's device, -1 once a row has finished,
    NON_FINITE (-2) where a row's logits were NaN or inf: the caller must stop there (checking it
    here would cost a host sync per step; the caller reads the tokens anyway).

    A row finishes when it emits one of eos_ids (the EOS token itself is yielded). The loop ends when
    every row has finished, after max_new_tokens, or when the context is full.

    processing: the request's penalties, bias, min_tokens and bad words (sampling/processors.py), applied
    to each step's logits before `sampling`; min_tokens holds back eos_ids.

    compile / cuda_graphs: how each decode step runs (CachedLoop); cuda_graphs None is on where the model is
    on a GPU, False is the eager loop (`--no-cuda-graphs`, for debugging).
    """
    device = model.device
    batch = PaddedBatch.left_pad(prompts, pad_id, device)
    n_new = plan_new_tokens(batch.ids.shape[1], max_new_tokens, model.config.max_position_embeddings)
    model.reserve_positions(batch.ids.shape[1] + n_new)  # RoPE tables for every position, before any compiled step
    loop = CachedLoop(model, batch, n_new, compile, cuda_graphs) if use_cache else RecomputeLoop(model, batch)
    eos = torch.tensor(list(eos_ids), device=device, dtype=torch.long)
    finished = torch.zeros(batch.ids.shape[0], dtype=torch.bool, device=device)
    process = None
    if processing is not None and processing.active:
        process = LoopProcessing(processing, batch.ids, model.config.vocab_size, eos_ids, batch.valid)
    logits = loop.start()
    for i in range(n_new):
        finite = None
        if process is not None:  # the model's logits are checked before processing bans tokens with -inf
            finite, logits = all_finite(logits), process(logits)
        tokens = sample(logits, sampling, generator, finite)  # (B,)
        if process is not None:
            process.push(tokens)
        yield torch.where(finished, -1, tokens)
        if not ignore_eos and len(eos):
            finished |= torch.isin(tokens, eos)
            if finished.all():  # the only host sync, and only when EOS can end the loop early
                return
        if i + 1 < n_new:
            logits = loop.step(tokens.clamp_min(0))  # NON_FINITE is no token id; the caller stops anyway


# A compiled step is recorded against its cache tensors' addresses (and guarded on them), so a new
# cache per generation would mean a new compile per generation. Compiled loops therefore share one
# cache per model and batch size, sized in whole blocks and grown only when a generation needs more.
_STATIC_CACHES: "weakref.WeakKeyDictionary[Qwen3, dict[int, KVCache]]" = weakref.WeakKeyDictionary()
CACHE_BLOCK = 256


def static_cache(model: Qwen3, batch_size: int, min_len: int) -> KVCache:
    """A reusable cache of at least min_len slots for compiled decoding (unwritten slots are masked)."""
    caches = _STATIC_CACHES.setdefault(model, {})
    cache = caches.get(batch_size)
    if cache is None or cache.max_len < min_len:
        max_len = min(-(-min_len // CACHE_BLOCK) * CACHE_BLOCK, model.config.max_position_embeddings)
        cache = caches[batch_size] = KVCache(model.config, batch_size, max_len, model.device, model.activation_dtype)
    cache.key_valid.fill_(True)  # prefill marks this generation's padding
    return cache


def compiled_decode_step(cache: KVCache, model: Qwen3):
    """decode_step compiled by inductor, with CUDA graphs on a GPU ("reduce-overhead"), as gpt-fast does.

    Decode is memory-bound but each step is dozens of small kernels; on a GPU, launching them one by
    one from Python costs more than running them. A CUDA graph replays the whole step with one launch.
    The cache tensors must keep fixed addresses for that, which mark_static_address promises. The
    compiled code is kept on disk (compile_cache.py), so a second start loads it instead of compiling.
    """
    torch._dynamo.mark_static_address(cache.keys)
    torch._dynamo.mark_static_address(cache.values)
    torch._dynamo.mark_static_address(cache.key_valid)
    return torch.compile(decode_step, fullgraph=True, options=compile_options(model, cache.keys.is_cuda))
