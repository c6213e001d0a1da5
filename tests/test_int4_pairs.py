"""int4's pairs layout (kernels/int4_pairs.py, AVX2's default): two rows' codes to a 32-bit lane,
each activation row rounded to int8 codes a group of 32 at a time. Its products equal the float64 product of the
dequantized matrix by the rounded rows to fp32 rounding, a row's bits are its own whatever rows are beside it, long
half-precision prompts run widened on rows rounded the same way, and a model in this layout decodes through its two
whole-half kernels what the dequantized model computes on rounded rows."""

import warnings

import pytest
import torch
from checkpoints import build_checkpoint
from test_int4 import prompt_and_steps
from torch import nn

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.kernels import int4, int4_pairs, matvec, widen
from qwen3_scratch.kernels.int4 import dequantize, quantize_groups
from qwen3_scratch.kernels.int4_pairs import Int4PairsLinear
from qwen3_scratch.model.qwen3 import DecoderLayer


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows (R, K) as the pairs' loop multiplies them: each group of 32 rounded to int8 codes times its scale."""
    return int4_pairs.rounded_rows(x.float())


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_rounding_keeps_each_groups_largest_at_127_a_zero_group_at_zero_and_sums_the_codes():
    x = torch.randn(96) * torch.logspace(-3, 2, 96)
    x[32:64] = 0.0
    codes, d, sums = int4_pairs.rounded(torch.stack([x, -x]), 3)
    assert codes.shape == (2, 3, 8, 4) and d.shape == sums.shape == (2, 3)
    assert torch.equal(codes[1], -codes[0]) and torch.equal(d[1], d[0]), "each row rounded on its own"
    codes, d, sums = codes[0].view(3, 32), d[0], sums[0]
    assert codes.dtype == torch.int32 and codes.abs().amax(-1).tolist() == [127, 0, 127]
    assert d[1] == 0 and torch.equal(sums, codes.sum(-1).float())
    assert ((codes * d[:, None] - x.view(3, 32)).abs() <= d[:, None] / 2 * (1 + 1e-6)).all(), "not rounded to nearest"


def test_pairs_hold_the_codes_and_multiply_the_rounded_rows_exactly_alone_or_in_blocks():
    torch.manual_seed(0)
    linear = nn.Linear(256, 16 * 9, bias=False)
    pairs = Int4PairsLinear(linear, torch.float32, 32)
    assert pairs.words and pairs.weight.shape == (9, 8, 8, 8) and pairs.weight.dtype == torch.int32
    codes, scales_and_zeros = quantize_groups(linear.weight.detach(), 32)
    assert torch.equal(int4_pairs.unpack_pairs(pairs.weight), codes.to(torch.uint8))
    assert torch.equal(pairs.scales_and_zeros, int4_pairs.pairs_scales(scales_and_zeros))
    # the load's compiled loop (a later start's) gives the eager packing's bits
    chunk = int4.quantize_codes(linear.weight.detach(), group_size=32)
    compiled = matvec.kernel(int4_pairs.pack_pairs_chunk, *chunk)(*chunk)
    assert all(torch.equal(a, b) for a, b in zip(compiled, int4_pairs.pack_pairs_chunk(*chunk), strict=True))
    matrix = dequantize(codes, scales_and_zeros)
    transposed = int4_pairs.dequantize_pairs_transposed(pairs.codes, pairs.scales_and_zeros, int4_pairs.SHIFTS)
    assert torch.equal(transposed, matrix.t()), "a long prompt's blocks"
    x = torch.randn(11, 256)  # a block of 8 rows (block_product), then 3 one at a time (row_product)
    got = pairs(x)
    exact = rounded_rows(x).double() @ matrix.double().t()
    assert relative(got, exact) < 1e-5, "the integer sums are exact: fp32 rounding only"
    assert relative(got, x.double() @ matrix.double().t()) > 1e-4, "the rows were not rounded"
    assert torch.equal(torch.cat([pairs(row[None]) for row in x]), got), "a row's bits depend on its neighbours"
    assert torch.equal(pairs(x.flip(0)), got.flip(0)), "a row's bits depend on its place in the blocks"


def test_half_precision_rows_are_rounded_few_through_the_loops_and_many_widened():
    torch.manual_seed(1)
    linear = nn.Linear(256, 16 * 5, bias=False)
    pairs = Int4PairsLinear(linear, torch.bfloat16, 32)
    codes, scales_and_zeros = quantize_groups(linear.weight.detach(), 32)
    matrix = dequantize(codes, scales_and_zeros.bfloat16()).double().t()
    few = torch.randn(3, 256).bfloat16()
    assert relative(pairs(few), rounded_rows(few).double() @ matrix) < 2**-7
    many = torch.randn(widen.MIN_INT4_WORDS_ROWS, 256).bfloat16()
    widened = pairs(many)
    assert relative(widened, rounded_rows(many).double() @ matrix) < 2**-7
    # the rows rounded as the loops round them: their products to fp32 rounding (then bf16's: a rare last bit), where
    # the rows unrounded move the products ~0.5% (rms)
    blocks = torch.cat([pairs(many[i : i + 8]) for i in range(0, len(many), 8)])
    assert rms(widened, blocks) < 1e-3 and rms(widened, many.double() @ matrix) > 2e-3, "a long prompt's rows unrounded"


def test_the_pairs_are_avx2s_default_or_asked_for_and_taken_where_they_hold(monkeypatch):
    linear = nn.Linear(256, 48, bias=False)
    monkeypatch.delenv("QWEN3_SCRATCH_INT4_LAYOUT")
    for avx2 in (True, False):
        monkeypatch.setattr(int4_pairs, "cpu_reads_words", lambda avx2=avx2: avx2)
        assert int4_pairs.holds(linear, 32) is avx2, "unset: the pairs on a CPU whose widest vectors are AVX2's"
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "words")
    assert not int4_pairs.holds(linear, 32)
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "pairs")
    assert int4_pairs.holds(linear, 32) and int4.words_by_default(), "a matrix the pairs cannot hold keeps the words"
    assert not int4_pairs.holds(linear, 64), "group size 32 only: the halves' sums are bounded for 8 words"
    assert not int4_pairs.holds(nn.Linear(256, 40, bias=False), 32), "rows in sixteens"
    assert not int4_pairs.holds(nn.Linear(256, 48, bias=False, device="meta"), 32), "a CPU's layout"
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "nibbles")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not int4_pairs.holds(linear, 32)
    assert not caught, "an unknown layout is named once, by the words' choice (test_int4.py), not per question"


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("int4-pairs"))


def test_a_model_in_pairs_decodes_by_its_halves_what_the_dequantized_model_computes_on_rounded_rows(tied, monkeypatch):
    """fp32 activations: the prompt as four blocks of 8 rows, then decode steps inside each layer's two kernels
    (the eager layers' logits to fp32 rounding). The reference is the dequantized fp32 model with every product's
    input rounded as the pairs round it; a row value that lies on a rounding boundary may round the other way in one
    of them, so the bar is 1e-4 of the largest logit, where not rounding the reference's rows moves them ~100 times
    as far."""
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "pairs")
    model = load_model(tied, dtype=torch.float32, quantize="int4", optimize="decode")
    assert isinstance(model.lm_head, Int4PairsLinear)
    assert model.model.layers[0].whole_halves() == "int4-pairs"
    reference = load_model(tied, dtype=torch.float32)
    with torch.no_grad():
        for module in reference.modules():
            if type(module) is nn.Linear:
                codes, scales_and_zeros = quantize_groups(module.weight, 32)
                module.weight = nn.Parameter(dequantize(codes, scales_and_zeros), requires_grad=False)
                module.register_forward_pre_hook(lambda m, args: rounded_rows(args[0].reshape(-1, m.in_features))
                                                 .view(args[0].shape))  # fmt: skip
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prompt_and_steps(model, tokens, 32)
    theirs = prompt_and_steps(reference, tokens, 32)
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-4 * scale
    for layer in model.model.layers:  # the same products through the eager layers (each its own kernel)
        layer.__class__ = DecoderLayer
    eager = prompt_and_steps(model, tokens, 32)
    assert (ours - eager).abs().max().item() <= 1e-6 * scale, "the halves differ from the eager layers"
    for module in reference.modules():
        module._forward_pre_hooks.clear()
    unrounded = prompt_and_steps(reference, tokens, 32)
    assert (unrounded - theirs).abs().max().item() > 1e-3 * scale, "rounding the rows changed nothing to see"
