"""Qwen3-MoE: our sparse MoE block and loader give transformers' logits and tokens, config for config."""

import json
import shutil

import pytest
import torch
from checkpoints import assert_logits_match, build_moe_checkpoint, load_moe_reference
from safetensors.torch import load_file, save_file

from qwen3_scratch import CheckpointError, ConfigError, GenerationError, load_model
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.model.moe import SparseMoeBlock, route
from qwen3_scratch.sampling.logits import LogitsFilter

# Each variant exercises one thing a wrong MoE could get wrong.
VARIANTS = {
    "norm_topk_single_file": dict(norm_topk_prob=True),
    "no_norm_topk_sharded": dict(norm_topk_prob=False, max_shard_size="40KB"),
    "sparse_step_2": dict(decoder_sparse_step=2, num_hidden_layers=4, norm_topk_prob=True),
    "mlp_only_layers": dict(mlp_only_layers=[0, 2], num_hidden_layers=3, max_shard_size="40KB"),
    "fused_experts_layout": dict(original_format=False, max_shard_size="40KB", norm_topk_prob=True),
    "top_3_of_8": dict(num_experts_per_tok=3),
}
GREEDY = LogitsFilter(temperature=0.0)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def random_ids(batch=2, length=64, seed=0):
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_fp32_logits_and_layer_kinds_match_transformers(checkpoint):
    """Bit-identical on this CPU (same ops, same order); the bar is the suite's 1e-5, as kernels may differ."""
    model, reference = load_model(checkpoint), load_moe_reference(checkpoint)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    theirs = [type(layer.mlp).__name__ for layer in reference.model.layers]
    assert kinds == [{"Qwen3MoeSparseMoeBlock": "SparseMoeBlock", "Qwen3MoeMLP": "MLP"}[t] for t in theirs], (
        "MoE and dense layers must sit where decoder_sparse_step and mlp_only_layers put them"
    )
    ids = random_ids()
    assert_logits_match(model(ids), reference(ids).logits, checkpoint.name)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16, norm_topk_prob=True)


def test_bf16_logits_follow_transformers_order_of_operations(bf16_checkpoint):
    """Same ops in the same dtypes: bf16 argmax agrees (>= 99% is the bar; on this CPU it is bit-identical)."""
    ids = random_ids(batch=4, length=128)
    ours = load_model(bf16_checkpoint, dtype="bfloat16")(ids)
    theirs = load_moe_reference(bf16_checkpoint, dtype=torch.bfloat16)(ids).logits
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"bf16 argmax agrees at only {agree:.1%} of positions (need >= 99%)"


def expert_inputs(block: SparseMoeBlock, tokens: int, dtype):
    x = torch.randn(tokens, block.gate.in_features, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    _, chosen = route(block.gate(x), block.top_k, block.norm_topk_prob)
    return x, chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_decode_and_grouped_expert_paths_agree(bf16_checkpoint, dtype):
    block = load_model(bf16_checkpoint, dtype=dtype).model.layers[0].mlp
    x, chosen = expert_inputs(block, 200, dtype)
    loop = block.experts_loop(x, chosen)
    assert torch.equal(block.experts_grouped(x, chosen), loop), "grouped runs the same matmuls on the same rows"
    # decode runs each token alone (matrix-vector): the same sums, but the kernel may add them in another
    # order, so the last bit can differ: within fp32 rounding, or one bf16 rounding (2^-8 relative)
    decode = block.experts_decode(x, chosen).float()
    worst, scale = (decode - loop.float()).abs().max().item(), loop.float().abs().max().item()
    assert worst <= (1e-6 if dtype == torch.float32 else 2**-8) * scale, f"decode path differs by {worst:.3g}"
    x1, chosen1 = x[:1], chosen[:1]
    assert torch.equal(block.experts_decode(x1, chosen1), block.experts_loop(x1, chosen1)), "one token: identical"


def test_decode_reads_only_the_chosen_experts(bf16_checkpoint):
    """Poison every expert the token did not choose: a path that touched one would return NaN."""
    model = load_model(bf16_checkpoint)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 1, block.gate.in_features, generator=torch.Generator().manual_seed(3))
    clean = block(x)
    _, chosen = route(block.gate(x[0]), block.top_k, block.norm_topk_prob)
    for e, expert in enumerate(block.experts):
        if e not in chosen.tolist()[0]:
            for linear in (expert.gate_proj, expert.up_proj, expert.down_proj):
                linear.weight = torch.nn.Parameter(torch.full_like(linear.weight, float("nan")), requires_grad=False)
    assert torch.equal(block(x), clean), "the one-token path read an expert the router did not choose"


@pytest.fixture(scope="module")
def generation_checkpoint(tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp("gen"), norm_topk_prob=True, max_shard_size="40KB")


def test_greedy_tokens_with_and_without_cache_equal_transformers_generate(generation_checkpoint):
    model = load_model(generation_checkpoint)
    ids = random_ids(1, 13, seed=5)[0].tolist()
    runs = {
        use_cache: [t.item() for t in generate_tokens(model, [ids], 20, GREEDY, use_cache=use_cache)]
        for use_cache in (True, False)
    }
    theirs = load_moe_reference(generation_checkpoint).generate(
        torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(ids) :].tolist()
    assert runs[True] == runs[False], "the KV cache changed the greedy tokens"
    assert runs[True] == theirs, "greedy tokens differ from transformers' generate"


def test_compile_is_refused_for_moe(generation_checkpoint):
    model = load_model(generation_checkpoint)
    with pytest.raises(GenerationError, match="--compile.*MoE"):
        next(generate_tokens(model, [[1, 2, 3]], 2, GREEDY, compile=True))


# The strict loader, on MoE checkpoints.


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp("pristine"), max_shard_size="40KB")


@pytest.fixture
def sharded(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def drop_tensors(path, prefix):
    """Delete every tensor whose name starts with prefix, from the shards and the index."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in {s for name, s in index["weight_map"].items() if name.startswith(prefix)}:
        tensors = load_file(path / shard)
        save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, path / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(prefix)}
    index_file.write_text(json.dumps(index))


def set_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_every_expert_parameter_is_the_checkpoint_tensor(sharded):
    model = load_model(sharded)
    stored = {}
    for shard in sharded.glob("model-*.safetensors"):
        stored.update(load_file(shard))
    ours = dict(model.named_parameters())
    assert set(ours) == set(stored), "parameter names must equal the Hub's per-expert keys"
    assert all(torch.equal(ours[name], tensor) for name, tensor in stored.items())


def test_fused_layout_loads_the_same_parameters_as_per_expert_keys(tmp_path):
    per_expert = load_model(build_moe_checkpoint(tmp_path / "a", max_shard_size="40KB"))
    fused = load_model(build_moe_checkpoint(tmp_path / "b", original_format=False))
    assert (tmp_path / "b" / "model.safetensors").exists()
    theirs = dict(fused.named_parameters())
    for name, param in per_expert.named_parameters():
        assert torch.equal(param, theirs[name]), f"{name} differs between the two layouts"


def test_missing_expert_weight_is_named(sharded):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    drop_tensors(sharded, name)
    with pytest.raises(CheckpointError, match=f"no tensor {name}"):
        load_model(sharded)


def test_missing_whole_expert_is_a_wrong_expert_count(sharded):
    drop_tensors(sharded, "model.layers.0.mlp.experts.7.")
    with pytest.raises(CheckpointError, match="layer 0 has 7 experts but config.json implies 8"):
        load_model(sharded)


def test_config_with_fewer_experts_than_the_files(sharded):
    set_config(sharded, num_experts=6)
    with pytest.raises(CheckpointError, match="layer 0 has 8 experts but config.json implies 6"):
        load_model(sharded)


def test_config_with_a_dense_layer_the_files_route(sharded):
    set_config(sharded, mlp_only_layers=[1])
    with pytest.raises(CheckpointError, match="layer 1 has 8 experts but config.json implies 0"):
        load_model(sharded)


def test_fused_experts_of_the_wrong_shape_name_the_checkpoint_key(tmp_path):
    path = build_moe_checkpoint(tmp_path, original_format=False)
    set_config(path, moe_intermediate_size=16)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.0.mlp.experts.\w+_proj is"):
        load_model(path)


# config.json


def hub_30b_a3b():
    """Qwen3-30B-A3B's config.json keys that matter here, as the Hub ships them."""
    from qwen3_scratch.model.sizes import moe_config_dict

    return moe_config_dict("30B-A3B")


def test_hub_config_of_qwen3_30b_a3b():
    from qwen3_scratch import Qwen3Config

    config = Qwen3Config.from_dict({**hub_30b_a3b(), "output_router_logits": True, "router_aux_loss_coef": 0.001})
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.norm_topk_prob and all(config.is_moe_layer(i) for i in range(48))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 129}, "num_experts_per_tok must be an integer between 1 and 128"),
        ({"num_experts": 0}, "num_experts must be an integer >= 1"),
        ({"moe_intermediate_size": 76.8}, "moe_intermediate_size"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": [48]}, "mlp_only_layers must hold layer indices in 0..47, got 48"),
        ({"mlp_only_layers": 3}, "mlp_only_layers must be a list"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size=5632 is not implemented"),
    ],
)
def test_bad_moe_configs_are_refused_naming_the_key(change, message):
    from qwen3_scratch import Qwen3Config

    with pytest.raises(ConfigError, match=message):
        Qwen3Config.from_dict({**hub_30b_a3b(), **change})


def test_published_moe_sizes_have_their_published_parameter_counts():
    from qwen3_scratch.model.sizes import moe_config_dict, moe_parameter_counts

    total, active = moe_parameter_counts(moe_config_dict("30B-A3B"))
    assert total == 30_532_122_624, "Qwen3-30B-A3B's model card and safetensors index count 30,532,122,624"
    assert 3.3e9 < active < 3.4e9, "the A3B: about 3.3B parameters active per token"
    total, active = moe_parameter_counts(moe_config_dict("235B-A22B"))
    assert 235e9 < total < 236e9 and 22e9 < active < 22.3e9, "235B total, 22B active"


def test_moe_parameter_count_equals_the_built_model(tmp_path):
    """The formula, checked against a real (tiny) model with a dense layer among the MoE ones."""
    from qwen3_scratch.model.sizes import moe_parameter_counts

    path = build_moe_checkpoint(tmp_path, mlp_only_layers=[1], num_hidden_layers=3)
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")  # transformers 5's name for it
    assert moe_parameter_counts(config)[0] == sum(p.numel() for p in load_model(path).parameters())


def test_decode_step_bytes_count_only_the_chosen_experts(pristine):
    """bandwidth_util must divide by what a step reads: batch 1 reads k of E experts per MoE layer."""
    from qwen3_scratch.generation.stats import bytes_per_decode_step, weight_bytes

    model = load_model(pristine)
    c = model.config
    expert = 3 * c.hidden_size * c.moe_intermediate_size * 4  # fp32
    embedding = c.vocab_size * c.hidden_size * 4  # untied: only lm_head's copy is read whole
    unread = c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * expert
    assert bytes_per_decode_step(model, c, 0, 1) == weight_bytes(model) - embedding - unread
    assert bytes_per_decode_step(model, c, 0, 64) > bytes_per_decode_step(model, c, 0, 1), "more rows, more experts"


def test_cli_generates_from_the_tiny_moe_checkpoint(tmp_path, capsys):
    """scripts/checkpoints/make_tiny_checkpoint.py --moe writes a checkpoint that the CLI and transformers both run alike."""
    from make_tiny_checkpoint import main as make_tiny

    from qwen3_scratch.cli.generate import main as cli
    from qwen3_scratch.text.tokenizer import Tokenizer

    make_tiny(["--moe", "--out", str(tmp_path / "tiny-moe")])
    path = tmp_path / "tiny-moe"
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
    capsys.readouterr()
    code = cli(["--model", str(path), "--prompt", "Hello", "--no-chat", "--temperature", "0",
                "--max-new-tokens", "12", "--ignore-eos", "--show-stats"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bandwidth_util=" in err.splitlines()[-1]
    tokenizer = Tokenizer.from_checkpoint(path)
    ids = tokenizer.encode("Hello")
    theirs = load_moe_reference(path).generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )[0, len(ids) :].tolist()
    assert out == tokenizer.decode(theirs) + "\n", "the CLI's greedy text differs from transformers' on the same ids"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_moe_matches_transformers(bf16_checkpoint):
    ids = random_ids(batch=4, length=128).cuda()
    ours = load_model(bf16_checkpoint, device="cuda", dtype="bfloat16")(ids)
    theirs = load_moe_reference(bf16_checkpoint, dtype=torch.bfloat16).cuda()(ids).logits
    assert ours.device.type == "cuda"
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"CUDA bf16 argmax agrees at only {agree:.1%} of positions"
