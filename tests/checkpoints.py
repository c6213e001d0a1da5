"""Random-weight Qwen3 checkpoints written by `transformers`, in the Hub's exact layout.

Every test that needs a checkpoint builds one here, so the suite is hermetic: no download, and the
reference model (`transformers`) is the one that wrote the files.
"""

import json
from pathlib import Path

import torch
import transformers

# Small but complete: GQA (4 query heads share 2 kv heads) and head_dim (32) != hidden / heads (16),
# so a model that derives head_dim or forgets to repeat kv heads is caught.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
)

def build_checkpoint(
    path,
    *,
    dtype=torch.float32,
    max_shard_size=None,
    config_style="hub",
    rope_scaling=None,
    seed=0,
    **overrides,
) -> Path:
    """Write a random Qwen3 with `transformers` and return its folder.

    max_shard_size: None writes one `model.safetensors`; e.g. "100KB" writes shards plus
        `model.safetensors.index.json`, as the Hub's larger models do.
    config_style: "hub" rewrites config.json with the keys the Hub's Qwen3 repos use
        (`rope_theta`, `rope_scaling`, `torch_dtype`); "transformers5" keeps what transformers 5
        writes (`rope_parameters`, `dtype`).
    """
    path = Path(path)
    kwargs = {**TINY, **overrides}
    rope_theta = kwargs.pop("rope_theta")
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
    config = transformers.Qwen3Config(rope_parameters=rope_parameters, **kwargs)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        # transformers initialises every RMSNorm weight to 1, which would hide a model that forgets
        # to multiply by the weight (or applies it in the wrong dtype). Make them all different.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model = model.to(dtype)
    shard_args = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **shard_args)
    if max_shard_size is None:
        _merge_into_single_file(path)
    if config_style == "hub":
        _rewrite_config_hub_style(path / "config.json")
    return path


def _merge_into_single_file(path: Path) -> None:
    """save_pretrained may still shard large models; make it exactly one model.safetensors."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return
    from safetensors.torch import load_file, save_file

    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(load_file(path / shard))
        (path / shard).unlink()
    index.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _rewrite_config_hub_style(config_path: Path) -> None:
    """Turn transformers 5's config keys into the ones the Hub's Qwen3 repos ship."""
    config = json.loads(config_path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    config.pop("layer_types", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def load_reference(path, dtype=torch.float32):
    """The same checkpoint through transformers: the numerical oracle."""
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def assert_logits_match(ours, theirs, what):
    """The suite's fp32 parity bar: max |Δ| <= 1e-5 x the largest logit."""
    scale = theirs.abs().max().item()
    worst = (ours.float() - theirs.float()).abs().max().item()
    assert worst <= 1e-5 * scale, f"{what}: max |Δ| = {worst:.3g}, allowed 1e-5 x max|logit| = {1e-5 * scale:.3g}"


# Qwen3-MoE, as small: 8 experts of width 32, 2 per token, on the dense TINY's attention shapes.
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)


def build_moe_checkpoint(path, *, dtype=torch.float32, max_shard_size=None, original_format=True, seed=0, **overrides):
    """Write a random Qwen3-MoE with `transformers` and return its folder (Hub-style config.json).

    original_format: True writes the Hub's per-expert keys (`mlp.experts.3.up_proj.weight`), which is
        what save_pretrained writes by default; False writes transformers 5's fused, stacked layout
        (`mlp.experts.gate_up_proj` (E, 2I, C), `mlp.experts.down_proj` (E, C, I)).
    """
    path = Path(path)
    kwargs = {**TINY_MOE, **overrides}
    rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    config = transformers.Qwen3MoeConfig(rope_parameters=rope_parameters, **kwargs)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, as in build_checkpoint
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                # transformers' init (std 0.02) makes every router probability ~1/E, so the top-k would
                # be decided by rounding noise; decisive routing is what a trained model has.
                param.normal_(0.0, 0.5)
    model = model.to(dtype)
    shard_args = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, save_original_format=original_format, **shard_args)
    if max_shard_size is None:
        _merge_into_single_file(path)
    _rewrite_config_hub_style(path / "config.json")
    return path


def load_moe_reference(path, dtype=torch.float32):
    """The MoE checkpoint through transformers, with its default experts implementation."""
    return transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype).eval()


def build_embedding_checkpoint(path, tokenizer_from, *, seed=0, **overrides) -> Path:
    """A random Qwen3-Embedding checkpoint in the Hub's layout: transformers' Qwen3Model saved alone (keys
    without `model.`, no lm_head), config.json saying "Qwen3ForCausalLM" as Qwen's embedding repos do, and
    the tokenizer files of the checkpoint folder `tokenizer_from` (its vocabulary size is kept)."""
    import shutil

    path, source = Path(path), Path(tokenizer_from)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    kwargs = {**TINY, "vocab_size": vocab_size, **overrides}
    rope_theta = kwargs.pop("rope_theta")
    config = transformers.Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **kwargs)
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    _merge_into_single_file(path)
    _rewrite_config_hub_style(path / "config.json")
    config_json = json.loads((path / "config.json").read_text())
    config_json["architectures"] = ["Qwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


def one_thread_for_tiny_shapes():
    """A module fixture's body: torch on one thread while the module runs (tiny shapes on a shared machine:
    a second thread only waits), then back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_ids(length: int, seed: int) -> list[int]:
    """A prompt of `length` random ids in the tiny checkpoints' vocabulary, the same for a seed."""
    return torch.randint(3, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_alone(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens for one prompt run by the simple loop: what the engine must give it in any batch."""
    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.sampling.logits import LogitsFilter

    return [int(t[0]) for t in generate_tokens(model, [ids], n, LogitsFilter(temperature=0.0))]
