"""Rotary position embeddings (RoPE), plain and YaRN-scaled.

RoPE encodes position by rotating pairs of channels of q and k by an angle proportional to the
position, so the dot product q.k depends only on the *distance* between two tokens. Each pair
rotates at its own frequency, from fast (local detail) to very slow (long range).

Qwen3, like transformers, pairs channel i with channel i + D/2 ("split-half"), not neighbours
(2i, 2i+1) as the original paper and Meta's Llama code do. The two layouts are the same maths on
permuted weights; we use split-half so the checkpoint's q_proj/k_proj work as stored, with no permute.

Shapes: B batch, T tokens, H heads, D head_dim, P positions in the table.
"""

import math

import torch

from .config import Qwen3Config


def inverse_frequencies(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq (D/2,), attention_scaling): the rotation speed of each channel pair."""
    dim, base = config.head_dim, config.rope_theta
    # The same float32 ops as transformers, so the angles agree to the last bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if config.rope_scaling is None:
        return inv_freq, 1.0
    return _yarn(inv_freq, base**exponents, dim, base, config.rope_scaling)


def _yarn(inv_freq, pos_freqs, dim, base, scaling) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): slow the low frequencies down by `factor`, keep the high ones.

    Channel pairs that complete many rotations within the original context already see every
    relative angle during training, so they keep their frequency ("extrapolate"). Pairs that rotate
    less than once would meet unseen angles at longer range, so they are slowed by `factor`
    ("interpolate"). A linear ramp blends the two in between.
    """
    original = scaling.original_max_position_embeddings

    def pair_index_for(rotations: float) -> float:
        # Which channel pair completes `rotations` full turns over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index_for(scaling.beta_fast), pair_index_for(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency, 0: fully interpolated
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    inv_freq = interpolated * (1 - keep) + inv_freq * keep
    attention_scaling = scaling.attention_factor
    if attention_scaling is None:
        attention_scaling = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return inv_freq, float(attention_scaling)


def rope_tables(
    config: Qwen3Config, device=None, dtype=torch.float32, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (P, D) for positions 0..P-1, P = `length` (default max_position_embeddings).

    The maths is fp32 (as transformers does it), then cast to the activation dtype. Both halves of
    the last dim share their angles (split-half), so only (P, D/2) is computed and then duplicated.
    Row p depends only on p, so a table built short and rebuilt longer holds the same values in its
    first rows as one built long at once.
    """
    inv_freq, attention_scaling = inverse_frequencies(config)
    length = config.max_position_embeddings if length is None else length
    positions = torch.arange(length, dtype=torch.float32, device=device)
    angles = positions[:, None] * inv_freq.to(device)[None, :]  # (P, D/2)
    tables = []
    for f in (torch.cos, torch.sin):
        half = (f(angles) * attention_scaling).to(dtype)  # (P, D/2)
        tables.append(torch.cat([half, half], dim=-1))  # (P, D)
    return tables[0], tables[1]


def table_length(needed: int, config: Qwen3Config) -> int:
    """How many positions to build when `needed` are asked for: the next power of two (so a growing
    context rebuilds the table only log-many times), within the configured context when that suffices."""
    return max(needed, min(1 << max(needed - 1, 0).bit_length(), config.max_position_embeddings))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim: a 90-degree turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles of its positions; cos/sin are (B, T, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): the same angle for every head
    return x * cos + rotate_half(x) * sin
