"""The GPU's ways to run int8 and int4 weights (kernels/quantize.py's routes, int4.py's CUDA packing) compute
what the CPU's do: the model whose matrices are the same quantized weights dequantized. Their expressions run
on a CPU too, so most is proven here; the CUDA tests check the real kernels. Speed: scripts/gpu_check.py."""

import pytest
import torch
import torch.nn.functional as F
from checkpoints import assert_logits_match, build_checkpoint
from torch import nn

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.errors import CheckpointError
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.kernels import matvec
from qwen3_scratch.kernels.quantize import Int8Linear, quantize_rows, use_int8_route
from qwen3_scratch.sampling.logits import LogitsFilter

GREEDY = LogitsFilter(temperature=0.0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("routes"))


def int8_reference(path, dtype, device="cpu"):
    """The plain model with each matrix replaced by its int8 weights times their scales."""
    model = load_model(path, device=device, dtype=dtype)
    for module in model.modules():
        if type(module) is nn.Linear:
            q, scales = quantize_rows(module.weight)
            module.weight = nn.Parameter((q.float() * scales[:, None]).to(dtype), requires_grad=False)
    return model


def greedy(model, ids, n=16, **kwargs):
    return torch.stack(list(generate_tokens(model, [ids], n, GREEDY, ignore_eos=True, **kwargs))).tolist()


@pytest.mark.parametrize("route", ["fused-cast", "int8pack", "row-kernel"])
def test_each_int8_route_equals_the_dequantized_reference(checkpoint, route):
    """fp32 logits to the suite's 1e-5 bar in a prompt, and the same greedy tokens through the graph runner."""
    model = load_model(checkpoint, dtype=torch.float32, quantize="int8", optimize="decode")
    use_int8_route(model, route)
    assert all(m.route == route for m in model.modules() if isinstance(m, Int8Linear))
    reference = int8_reference(checkpoint, torch.float32)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    assert_logits_match(model(x), reference(x), f"int8 route {route}, prefill of 2 rows")
    ids = x[0, :9].tolist()
    assert greedy(model, ids, cuda_graphs=True) == greedy(reference, ids), f"int8 route {route}: greedy tokens"


def test_fused_cast_in_fp32_gives_the_bf16_products_bits():
    """The route multiplies by the scales in fp32 (so inductor's int8 pattern does not swap in its slow CUDA
    kernel); that must round to exactly the bf16 product times bf16 scales, gpt-fast's expression."""
    layer = Int8Linear(nn.Linear(256, 96, bias=False), torch.bfloat16)
    use_int8_route(layer, "fused-cast")
    x = torch.randn(3, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    gpt_fast = F.linear(x, layer.weight.to(torch.bfloat16)) * layer.scales
    assert torch.equal(layer(x), gpt_fast), "the fp32 multiply changed the bf16 result"


def test_the_row_kernel_runs_one_row_compiled_and_several_by_the_fused_cast():
    """A one-row product is one compiled kernel (the cast inside its reduction): in fp32 it is the fused cast's
    product within summation order, and the rows of a prefill run the fused cast itself, bit for bit."""
    layer = Int8Linear(nn.Linear(256, 96, bias=False), torch.float32)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    use_int8_route(layer, "fused-cast")
    fused_rows, fused_row = layer(x), layer(x[:1, None])
    use_int8_route(layer, "row-kernel")
    assert torch.equal(layer(x), fused_rows), "several rows: the fused-cast expression"
    one = layer(x[:1, None])
    assert one.shape == (1, 1, 96)
    torch.testing.assert_close(one, fused_row, rtol=1e-5, atol=1e-5)
    assert any(key[0] == "int8_row" for key in matvec._KERNELS), "the one row ran the compiled kernel"


def test_an_unknown_int8_route_is_refused_naming_the_choices(checkpoint):
    model = load_model(checkpoint, quantize="int8")
    with pytest.raises(CheckpointError, match="int8 route 'fast' is not one of cpu, fused-cast, int8pack, row-kernel"):
        use_int8_route(model, "fast")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("route", ["row-kernel", "fused-cast"])
def test_cuda_int8_routes_give_the_dequantized_references_tokens(checkpoint, route):
    """The GPU's int8 routes, replayed from CUDA graphs, in fp32: the dequantized model's greedy tokens. The
    "decode" layout's default there is one compiled kernel a one-row product (row-kernel)."""
    model = load_model(checkpoint, device="cuda", dtype=torch.float32, quantize="int8", optimize="decode")
    assert model.lm_head.route == "row-kernel", "on a GPU one-row int8 products default to their own kernels"
    use_int8_route(model, route)
    ids = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = int8_reference(checkpoint, torch.float32, "cuda")
    assert greedy(model, ids, 24) == greedy(reference, ids, 24), f"int8 {route} on CUDA"


@pytest.mark.cuda
@needs_cuda
def test_cuda_int8pack_route_stays_within_bf16_rounding_of_fused_cast(checkpoint):
    """torch's CUDA int8 kernel and the fused cast compute the same products in bf16, summed in other orders."""
    model = load_model(checkpoint, device="cuda", dtype=torch.bfloat16, quantize="int8", optimize="decode")
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7), device="cuda")
    fused = model(x).float()
    use_int8_route(model, "int8pack")
    worst = ((model(x).float() - fused).abs().max() / fused.abs().max()).item()
    assert worst < 0.06, f"int8pack logits differ from fused-cast's by {worst:.3g} of the largest"


@pytest.mark.cuda
@needs_cuda
def test_cuda_int4_logits_stay_within_bf16_rounding_of_the_cpu_kernels(checkpoint):
    """tinygemm's packing (8 inner k-tiles where K allows) on the GPU against torch's CPU int4 kernel on the
    same codes: both dequantize the same groups, so they differ by bf16 rounding only."""
    x = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(6))
    gpu = load_model(checkpoint, device="cuda", dtype=torch.bfloat16, quantize="int4")(x.cuda()).float().cpu()
    cpu = load_model(checkpoint, dtype=torch.bfloat16, quantize="int4")(x).float()
    worst = ((gpu - cpu).abs().max() / cpu.abs().max()).item()
    assert worst < 0.06, f"int4 logits on CUDA differ from the CPU kernel's by {worst:.3g} of the largest"
