"""The one-query attention used for CPU decode in half precision equals SDPA, alone and inside the model."""

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch, RecomputeLoop
from qwen3_scratch.model.qwen3 import one_query_attention


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (8, 2), (4, 4)])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("layout", ["batch-major", "head-major", "head-major, sliced"])  # the paged gather's
def test_one_query_attention_equals_sdpa(dtype, tolerance, heads, kv_heads, masked, layout):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    B, S, D = 3, 37, 64
    q = torch.randn(B, heads, 1, D, generator=g).to(dtype)
    if layout == "batch-major":
        k, v = (torch.randn(B, kv_heads, S, D, generator=g).to(dtype) for _ in range(2))
    else:  # (K, B, S', D) storage seen as (B, K, S', D), then cut to the S keys attended
        extra = 5 if layout.endswith("sliced") else 0
        k, v = (torch.randn(kv_heads, B, S + extra, D, generator=g).to(dtype).transpose(0, 1)[:, :, :S]
                for _ in range(2))  # fmt: skip
    mask = (torch.rand(B, 1, 1, S, generator=g) > 0.3) if masked else None
    if masked:
        mask[..., 0] = True  # every row sees at least one key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).float()
    got = one_query_attention(q, k, v, mask).float()
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"{dtype} H={heads} K={kv_heads} masked={masked}: relative error {error:.2e}"


def test_bf16_decode_logits_follow_the_full_recompute(tmp_path):
    """Each cached decode step (one-query attention) against recomputing the whole sequence (SDPA)."""
    model = load_model(build_checkpoint(tmp_path, seed=3), dtype="bfloat16")
    batch = PaddedBatch.left_pad([[5, 9, 2, 7, 11, 3], [4, 4, 8]], pad_id=0, device="cpu")  # padded rows too
    cached, recompute = CachedLoop(model, batch, n_new=6), RecomputeLoop(model, batch)
    a, b = cached.start(), recompute.start()
    for step in range(6):
        tokens = a.argmax(-1)
        a, b = cached.step(tokens), recompute.step(tokens)
        error = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert error < 2e-2, f"decode step {step}: cached logits differ from the recompute by {error:.2e}"
