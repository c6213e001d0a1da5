"""Our hand-written Qwen3 gives the same logits as transformers, config for config."""

import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint, load_reference

from qwen3_scratch import KVCache, load_model
from qwen3_scratch.model.kv_cache import attention_mask

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# Each variant exercises one thing a wrong model could get wrong.
VARIANTS = {
    "single_file_tied_gqa": dict(),
    "sharded_with_index": dict(max_shard_size="40KB"),
    "untied_lm_head": dict(tie_word_embeddings=False),
    "mha_no_gqa": dict(num_key_value_heads=4),
    "head_dim_equals_hidden_over_heads": dict(head_dim=16),
    "yarn_rope": dict(rope_scaling=YARN),
    "transformers5_config_keys": dict(config_style="transformers5", max_shard_size="40KB"),
    "transformers5_yarn": dict(config_style="transformers5", rope_scaling=YARN),
    "stored_bf16": dict(dtype=torch.bfloat16, max_shard_size="40KB"),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def random_ids(batch=2, length=96, vocab=512, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_fp32_logits_match_transformers(checkpoint):
    ids = random_ids()
    ours = load_model(checkpoint, dtype=torch.float32)(ids)
    theirs = load_reference(checkpoint, dtype=torch.float32)(ids).logits
    assert ours.shape == theirs.shape == (2, 96, 512)
    assert_logits_match(ours, theirs, checkpoint.name)


def test_yarn_logits_match_beyond_the_original_context(tmp_path):
    """Past original_max_position_embeddings is where YaRN's interpolated frequencies matter most."""
    path = build_checkpoint(tmp_path, rope_scaling=YARN, max_position_embeddings=256)
    ids = random_ids(batch=1, length=200)
    assert_logits_match(load_model(path)(ids), load_reference(path)(ids).logits, "yarn at 200 > 64 tokens")


def test_bf16_argmax_matches_transformers(tmp_path):
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16, max_shard_size="40KB")
    ids = random_ids(batch=4, length=128)
    ours = load_model(path, dtype="bfloat16")(ids)
    theirs = load_reference(path, dtype=torch.bfloat16)(ids).logits
    assert ours.dtype == torch.bfloat16
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"bf16 argmax agrees at only {agree:.1%} of positions (need >= 99%)"


def test_padded_batch_matches_each_row_alone(tmp_path):
    """Left padding + per-row positions + a padding mask must not change any real token's logits."""
    path = build_checkpoint(tmp_path)
    model = load_model(path)
    long, short = random_ids(1, 40, seed=1)[0], random_ids(1, 25, seed=2)[0]
    pad = len(long) - len(short)
    ids = torch.stack([long, torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, :pad] = False
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, positions, mask=attention_mask(torch.arange(40), valid))
    assert_logits_match(logits[0], model(long[None])[0], "unpadded row")
    assert_logits_match(logits[1, pad:], model(short[None])[0], "left-padded row")


def test_cached_decode_matches_full_forward(tmp_path):
    """Prefill + one-token steps through the KV cache give the same logits as one full forward."""
    path = build_checkpoint(tmp_path)
    model = load_model(path)
    ids = random_ids(1, 30)
    full = model(ids)
    cache = KVCache(model.config, batch_size=1, max_len=30)
    steps = [model(ids[:, :20], cache=cache, cache_slots=torch.arange(20))]
    for t in range(20, 30):
        steps.append(model(ids[:, t : t + 1], torch.tensor([[t]]), cache=cache, cache_slots=torch.tensor([t])))
    assert_logits_match(torch.cat(steps, dim=1), full, "prefill + cached decode")


def test_removing_q_norm_breaks_parity(tmp_path):
    """The suite must notice a missing piece: skip q_norm and the logits must drift."""
    path = build_checkpoint(tmp_path)
    model = load_model(path)
    for layer in model.model.layers:
        layer.self_attn.q_norm.forward = lambda x: x
    ids = random_ids()
    worst = (model(ids) - load_reference(path)(ids).logits).abs().max().item()
    assert worst > 1e-3, "a model without q_norm still matched transformers: the parity test is too weak"


def test_last_only_returns_the_final_position(tmp_path):
    model = load_model(build_checkpoint(tmp_path))
    ids = random_ids()
    last = model(ids, last_only=True)
    assert last.shape == (2, 1, 512)
    assert_logits_match(last, model(ids)[:, -1:], "last_only")


def test_load_model_returns_eval_model_with_frozen_weights(tmp_path):
    model = load_model(build_checkpoint(tmp_path))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied lm_head must share the embedding"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_matches_transformers(tmp_path):
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16, max_shard_size="40KB")
    ids = random_ids(batch=4, length=128).cuda()
    ours = load_model(path, device="cuda", dtype="bfloat16")(ids)
    theirs = load_reference(path, dtype=torch.bfloat16).cuda()(ids).logits
    assert ours.device.type == "cuda" and ours.dtype == torch.bfloat16
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"CUDA bf16 argmax agrees at only {agree:.1%} of positions"
