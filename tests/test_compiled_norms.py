"""kernels/norms.py: RMSNorm as one compiled kernel (an opt-in for graphed GPU decode, measured there by
scripts/gpu_check.py's bfloat16/graphs-norms). On a CPU inductor compiles the same graph to C++: the norms'
outputs agree with the eager ones within fp32 rounding, the graph runner's greedy tokens are the eager loop's
(fp32 and bf16), a prompt of another length reuses the kernels, and uncompile_norms restores the eager model."""

import pytest
import torch
from checkpoints import build_checkpoint
from torch._dynamo.utils import counters

from qwen3_scratch import load_model
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.kernels.norms import CompiledRMSNorm, compile_norms, uncompile_norms
from qwen3_scratch.model.qwen3 import RMSNorm
from qwen3_scratch.sampling.logits import LogitsFilter

GREEDY = LogitsFilter(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("norms"))


def tokens(model, ids, n):
    return [int(t[0]) for t in generate_tokens(model, [ids], n, GREEDY, cuda_graphs=True)]


def test_a_compiled_norm_is_the_eager_norm_within_fp32_rounding():
    norm = RMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight)
    for shape in ((1, 5, 64), (2, 1, 3, 64)):
        x = torch.randn(shape) * 4
        eager = norm(x)
        norm.__class__ = CompiledRMSNorm
        torch.testing.assert_close(norm(x), eager, rtol=2e-6, atol=1e-6)
        norm.__class__ = RMSNorm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_decode_with_compiled_norms_gives_the_eager_tokens(checkpoint, dtype):
    model = load_model(checkpoint, dtype=dtype)
    prompts = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 12)]
    eager = [tokens(model, ids, 10) for ids in prompts]
    n = compile_norms(model)
    layers = model.config.num_hidden_layers
    assert n == 4 * layers + 1, "input, q, k and post-attention norms of every layer, and the final one"
    try:
        assert [tokens(model, ids, 10) for ids in prompts] == eager, f"{dtype}: compiled norms changed the tokens"
        graphs = counters["stats"]["unique_graphs"]
        tokens(model, list(range(3, 33)), 4)  # another prompt length, another batch step count
        assert counters["stats"]["unique_graphs"] == graphs, "a prompt of another length compiled the norms again"
    finally:
        assert uncompile_norms(model) == n
    assert not any(isinstance(m, CompiledRMSNorm) for m in model.modules())
