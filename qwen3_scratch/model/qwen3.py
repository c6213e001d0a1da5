"""Qwen3, top to bottom: embedding -> L x (attention + SwiGLU MLP) -> norm -> lm_head -> logits.

Module and parameter names equal the checkpoint's keys (`model.layers.0.self_attn.q_norm.weight`),
so loading is a loop over names. The order of operations follows transformers' modeling_qwen3.py,
which is our numerical oracle: same ops in the same dtypes give the same bf16 logits, not just
close ones.

Shapes: B batch, T tokens in this forward, S key slots attended, C hidden_size, H query heads,
K kv heads, D head_dim, F intermediate_size, V vocab_size.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3Config
from .kv_cache import KVCache, attention_mask
from .moe import SparseMoeBlock
from .rope import apply_rope, rope_tables, table_length

# Positions the RoPE tables cover at load; they grow on demand (reserve_positions), never to a size
# config.json alone decides (max_position_embeddings of 10^8 would be 12.8 GB of tables).
INITIAL_ROPE_POSITIONS = 4096


class RMSNorm(nn.Module):
    """x / rms(x) * weight: LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()  # the mean of squares overflows/underflows in bf16, so normalise in fp32
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back *before* multiplying by the weight: that is the order Qwen3 was trained with,
    # and the order transformers uses, so bf16 results match bit for bit.
    return weight * x.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3's "q/k-norm")."""

    def __init__(self, config: Qwen3Config, layer_index: int):
        super().__init__()
        C, H, K, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer_index, self.n_heads, self.n_kv_heads, self.head_dim = layer_index, H, K, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(C, H * D, bias=bias)  # 0.6B: 1024 -> 2048, wider than the residual
        self.k_proj = nn.Linear(C, K * D, bias=bias)
        self.v_proj = nn.Linear(C, K * D, bias=bias)
        self.o_proj = nn.Linear(H * D, C, bias=bias)
        # Normalising each head's q and k bounds the attention logits, which keeps training stable.
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def project_qkv(self, x):
        """q, k, v from x (B, T, C). After kernels/fuse.py's load-time transform, one matmul (qkv_proj) reads all
        three matrices: one weight stream instead of three, which is what batch-1 decode is bound by."""
        if hasattr(self, "qkv_proj"):
            return self.qkv_proj(x).split(self.qkv_proj.split_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None, cache_slots=None):
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)  # (B, T, H*D), (B, T, K*D), (B, T, K*D)
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim))  # (B, T, H, D)
        k = self.k_norm(k.view(B, T, self.n_kv_heads, self.head_dim))  # (B, T, K, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, K, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # norm first, then rotate
        return self.o_proj(self.attend(q, k, v, mask, cache, cache_slots))  # (B, T, C)

    def attend(self, q, k, v, mask=None, cache: KVCache | None = None, cache_slots=None):
        """q (B, H, T, D), k, v (B, K, T, D) -> (B, T, H*D): through the cache when there is one."""
        B, _, T, _ = q.shape
        if hasattr(cache, "attend"):  # a cache that attends where its keys lie (the engine's paged pool)
            y = cache.attend(self.layer_index, q, k, v, mask)  # (B, H, T, D)
            return y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        if cache is not None:
            k, v = cache.update(self.layer_index, k, v, cache_slots)  # (B, K, max_len, D)
            # Attend over as many slots as the mask has columns: the slots written so far in eager
            # decoding (cost follows the context), or all of them when shapes must stay fixed (CUDA graphs).
            S = mask.shape[-1]
            k, v = k[:, :, :S], v[:, :, :S]  # (B, K, S, D)
        if T == 1 and q.device.type == "cpu" and q.dtype != torch.float32:
            y = one_query_attention(q, k, v, mask)  # CPU decode in bf16/fp16: see the function
        else:
            # No mask means plain causal over these T tokens, which is what is_causal=True does.
            # enable_gqa lets each group of H/K query heads read its shared kv head without copying it.
            # SDPA computes the softmax in fp32 even for bf16 inputs.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)


def one_query_attention(q, k, v, mask=None):
    """Attention for one new token per row: q (B, H, 1, D) over k, v (B, K, S, D) -> (B, H, 1, D).

    Why not SDPA: on a CPU its kernel for a single query row reads the cache slowly in half precision
    (16 rows x 512 keys, one layer: 26 ms in bf16, 3.6 ms this way; docs/performance.md), which made
    batched decode attention-bound. Two matmuls and a softmax, in transformers' eager order: scores in
    the activations' dtype, masked, softmax in fp32, cast back, times v. GQA without copying the cache:
    the G = H/K query heads that share a kv head become G rows of one product.
    """
    B, H, _, D = q.shape
    K = k.shape[1]
    q = q.view(B, K, H // K, D)  # (B, K, G, D)
    mask = None if mask is None else mask.view(B, 1, 1, -1)  # (B, 1, 1, S)
    # Batch over the order the keys are stored in: a paged gather hands them over head-major, and a
    # batched matmul over strided keys is several times slower than over contiguous ones.
    # Head-major: kv heads outermost in memory, each head's (S, D) keys in rows of D (a slice of the
    # gathered slots keeps both, so this is not `is_contiguous()`).
    head_major = B > 1 and k.stride(1) > k.stride(0) and k.stride(2) == D and k.stride(3) == 1
    if head_major:  # (K, B, ...) throughout, q made contiguous in that order (it is small)
        q, k, v = q.transpose(0, 1).contiguous(), k.transpose(0, 1), v.transpose(0, 1)
        mask = None if mask is None else mask.transpose(0, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * D**-0.5  # (B, K, G, S), or (K, B, G, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    y = torch.matmul(probs, v)  # (B, K, G, D), or (K, B, G, D)
    return (y.transpose(0, 1) if head_major else y).reshape(B, H, 1, D)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the gate decides, per channel, how much of up passes."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        C, Fi = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(C, Fi, bias=False)
        self.up_proj = nn.Linear(C, Fi, bias=False)
        self.down_proj = nn.Linear(Fi, C, bias=False)

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):  # fused at load time (kernels/fuse.py): one matmul for both
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.split_sizes, dim=-1)  # (B, T, F) each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)  # (B, T, F) -> (B, T, C)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: Qwen3Config, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Qwen3-MoE: most layers route each token to k of E small experts; the rest keep the dense MLP.
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_index) else MLP(config)

    def forward(self, x, cos, sin, mask=None, cache=None, cache_slots=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """The transformer body: token ids (B, T) -> final hidden states (B, T, C), normed.

    Qwen3-Embedding checkpoints are this alone (no lm_head); their embedding is the last token's row."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, cos, sin, mask=None, cache: KVCache | None = None, cache_slots=None):
        """input_ids (B, T), RoPE cos/sin (B, T, D) of their positions -> hidden states (B, T, C)."""
        x = self.embed_tokens(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, cache_slots)
        return self.norm(x)  # per token, so normalising all T rows equals normalising the ones used


class Qwen3(nn.Module):
    def __init__(self, config: Qwen3Config, head: bool = True):
        """head=False: the body alone (an embedding checkpoint); forward() then refuses, hidden_states() works."""
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        if config.tie_word_embeddings and head:
            # One matrix both maps ids to vectors and scores vectors against every id.
            self.lm_head.weight = self.model.embed_tokens.weight
        # cos/sin for the positions generations have needed so far; not saved with the weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of activations, logits and the KV cache: the embedding's. (A quantized or prepacked
        lm_head keeps its weight in its own format, so its dtype says nothing about the activations.)"""
        return self.model.embed_tokens.weight.dtype

    def build_rope_tables(self, device=None, dtype=None, length: int | None = None):
        """Fill the cos/sin tables (fp32 maths, then cast to the activation dtype, as transformers does)."""
        dtype = dtype or self.activation_dtype
        length = length or min(INITIAL_ROPE_POSITIONS, self.config.max_position_embeddings)
        self.rope_cos, self.rope_sin = rope_tables(self.config, device, dtype, length)

    def reserve_positions(self, n: int) -> None:
        """Make the RoPE tables cover positions 0..n-1, rebuilding them longer if needed.

        Call it before a generation (prompt + max_new_tokens) rather than inside the decode step: a
        compiled or CUDA-graph step must find its tables already there, at a fixed address.
        """
        if n > self.rope_cos.shape[0]:
            self.build_rope_tables(self.device, self.rope_cos.dtype if self.rope_cos.numel() else None,
                                   table_length(n, self.config))  # fmt: skip

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_slots: torch.Tensor | None = None,
        last_only: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V), or (B, 1, V) with last_only, or (B, M, V) at logits_at.

        position_ids (B, T): each token's RoPE position; default 0..T-1 (left-padded rows start later).
        mask (B, 1, T, S) bool: which keys each query may see; default causal over the T tokens.
        cache: write this forward's keys/values at cache_slots (T,) and attend over the first S slots,
            S = mask.shape[-1]; the mask defaults to causal-by-slot over all of the cache's slots. A cache
            with an `attend(layer, q, k, v, mask)` method writes and attends itself (the engine's paged pool).
        logits_at (M,): the token indices whose logits to compute; the engine packs many sequences into
            one forward (engine/batch.py) and needs the next-token scores of a few of its tokens only.
        """
        if self.lm_head is None:
            raise ValueError("this is an embedding checkpoint (no lm_head): it has hidden states, not logits")
        x = self.hidden_states(input_ids, position_ids, mask, cache, cache_slots)  # (B, T, C)
        if last_only:
            x = x[:, -1:, :]  # (B, 1, C): generation only needs the next token's scores
        elif logits_at is not None:
            x = x[:, logits_at, :]  # (B, M, C)
        return self.lm_head(x)  # (B, T, V)

    def hidden_states(self, input_ids, position_ids=None, mask=None, cache: KVCache | None = None, cache_slots=None):
        """input_ids (B, T) -> the body's final hidden states (B, T, C); arguments as forward's. Not itself
        no_grad: forward's undecorated self (`Qwen3.forward.__wrapped__`) is what training differentiates."""
        B, T = input_ids.shape
        if position_ids is None:
            self.reserve_positions(T)
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        elif position_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            # Free on the host; on a GPU it would sync every step, so the generation loop reserves first.
            self.reserve_positions(int(position_ids.max()) + 1)
        if cache is not None:
            if cache_slots is None:
                cache_slots = position_ids[0]
            if mask is None and not hasattr(cache, "attend"):  # a cache that attends itself knows its rows
                mask = attention_mask(cache_slots, cache.key_valid)
        cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]  # (B, T, D) each
        return self.model(input_ids, cos, sin, mask, cache, cache_slots)  # (B, T, C)
