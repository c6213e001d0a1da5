"""Products of many bf16 rows in fp32 on a CPU without bf16 instructions (kernels/widen.py).

The widened product sums exact fp32 products of the same bf16 (or fp16) inputs, in another order than torch's
kernels, then rounds once: the bar is the half-precision rounding of the exact (fp64) product, as for F.linear
itself. Every CPU runs these tests: where the CPU has bf16 instructions, the tests say it has none."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from checkpoints import build_checkpoint

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.kernels import fuse, int4, widen
from qwen3_scratch.kernels.int4 import PACK_ROWS, Int4Linear
from qwen3_scratch.kernels.matvec import MatvecLinear, jit_kernel
from qwen3_scratch.kernels.quantize import Int8Linear, dequantized_weight
from qwen3_scratch.kernels.widen import BLOCK_ROWS, MIN_INT4_ROWS, MIN_INT8_ROWS, MIN_ROWS, WideLinear


def within_rounding(y, x, w, dtype, bias=None):
    """|y - exact| <= half an ulp of dtype at the exact product's magnitude, plus what an fp32 sum of K terms can
    miss by (K ulps of fp32 of the sum of the terms' sizes: it matters where the terms cancel), plus half the
    spacing of dtype's subnormals. exact: the fp64 product of the same half-precision inputs."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    finfo, k = torch.finfo(dtype), w.shape[1]
    sum_error = (x.double().abs() @ w.double().abs().T) * k * 2**-24
    bound = exact.abs() * finfo.eps / 2 + sum_error + finfo.smallest_normal * finfo.eps / 2
    return bool(((y.double() - exact).abs() <= bound).all())


@pytest.fixture
def no_bf16_instructions(monkeypatch):
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: False)


@pytest.mark.parametrize("rows,n,k,dtype", [(MIN_ROWS, 96, 64, torch.bfloat16),
                                            (40, BLOCK_ROWS * 2 + 37, 72, torch.bfloat16),  # blocks and a part
                                            (300, 33, 1024, torch.bfloat16),
                                            (17, 600, 128, torch.float16)])  # fmt: skip
def test_widened_products_round_like_f_linear(rows, n, k, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    y = widen.linear(x, w)
    assert y.dtype == dtype and y.shape == (rows, n)
    assert within_rounding(y, x, w, dtype)
    assert within_rounding(F.linear(x, w), x, w, dtype), "F.linear itself misses the bar: the bar is wrong"


def test_a_bias_and_leading_dimensions_are_kept():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 64, generator=generator).bfloat16()  # (B, T, K)
    w, bias = torch.randn(48, 64, generator=generator).bfloat16(), torch.randn(48, generator=generator).bfloat16()
    y = widen.linear(x, w, bias)
    assert y.shape == (2, 9, 48) and y.dtype == torch.bfloat16
    assert within_rounding(y.view(-1, 48), x.view(-1, 64), w, torch.bfloat16, bias)


def test_only_many_half_precision_rows_on_a_cpu_without_bf16_instructions_are_widened(monkeypatch):
    many, few = torch.zeros(MIN_ROWS, 64, dtype=torch.bfloat16), torch.zeros(MIN_ROWS - 1, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: False)
    assert widen.widens(many, 64) and widen.widens(many.view(2, -1, 64), 64) and widen.widens(many.half(), 64)
    assert not widen.widens(few, 64), "a few rows run torch's kernel"
    assert not widen.widens(many, 64, MIN_INT8_ROWS), "a quantized matrix's threshold is its own"
    assert not widen.widens(many.float(), 64), "fp32 is fp32 already"
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: True)
    assert not widen.widens(many, 64), "a CPU with bf16 instructions multiplies bf16 itself"


def count_widened(monkeypatch, name: str = "linear") -> list:
    """Every call of widen.<name> from now on, noted by its second argument (the matrix, or its rows)."""
    calls = []
    real = getattr(widen, name)
    monkeypatch.setattr(widen, name, lambda *args: calls.append(args[1]) or real(*args))
    return calls


@pytest.mark.parametrize("layout", ["decode", "batch"])
def test_a_prompt_runs_widened_with_the_plain_models_logits(tmp_path, monkeypatch, no_bf16_instructions, layout):
    """A prompt through the CLI's layout (matvec.MatvecLinear) and the engine's (WideLinear) runs its products
    widened, with the logits of the checkpoint's own layers within bf16 rounding. oneDNN here says it has bf16 (as
    on any AVX-512 CPU, where it emulates it without the instructions): the widened products still take the matrices."""
    monkeypatch.setattr(fuse, "can_prepack", lambda model: True)
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16)
    fast = load_model(path, dtype=torch.bfloat16, optimize=layout)
    plain = load_model(path, dtype=torch.bfloat16)
    assert type(fast.lm_head) is (MatvecLinear if layout == "decode" else WideLinear)
    calls = count_widened(monkeypatch)
    prompt = torch.arange(3, 3 + 2 * MIN_ROWS).view(1, -1)
    with torch.no_grad():
        ours, reference = fast(prompt).float(), plain(prompt).float()
    assert len(calls) >= len(fast.model.layers) * 4 + 1, "every product of the prompt runs widened"
    assert (ours.argmax(-1) == reference.argmax(-1)).all()
    assert (ours - reference).abs().max() <= 0.05 * reference.abs().max(), "more than bf16 rounding apart"


def test_models_that_gain_nothing_keep_their_products(tmp_path, monkeypatch):
    """fp32 models, and bf16 ones on a CPU with bf16 instructions, get no WideLinear."""
    assert not any(isinstance(m, WideLinear) for m in load_model(build_checkpoint(tmp_path / "fp32"),
                                                                 optimize="batch").modules())  # fmt: skip
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: True)
    path = build_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_model(path, dtype=torch.bfloat16, optimize="batch")
    assert not any(isinstance(m, WideLinear) for m in model.modules())


UNPACK_CHECK = """
import torch
from qwen3_scratch.kernels import int4
codes = torch.randint(0, 16, (3 * int4.PACK_ROWS, 96), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
packed = int4.pack(codes)
print(torch.backends.cpu.get_cpu_capability(), int4.cpu_packing(),
      torch.equal(int4.unpack(packed), codes.to(torch.uint8)),
      torch.equal(int4.unpack(packed[int4.PACK_ROWS:]), codes[int4.PACK_ROWS:].to(torch.uint8)))
"""


def test_int4_unpack_reads_torchs_cpu_packing_exactly():
    """int4.unpack gives back the codes torch's CPU packing was given, for the whole and for a block of rows alone:
    pins the packing's layout, so a torch that packs otherwise fails here, not in a prompt."""
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2 * PACK_ROWS, 96), generator=generator, dtype=torch.int32)
    packed = int4.pack(codes)
    assert torch.equal(int4.unpack(packed), codes.to(torch.uint8))
    assert torch.equal(int4.unpack(packed[PACK_ROWS:]), codes[PACK_ROWS:].to(torch.uint8)), "a block of rows alone"


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_int4_unpack_reads_each_instruction_sets_packing(capability):
    """torch packs int4 for the CPU differently under each instruction set it dispatches to (AVX-512 CPUs got codes
    read in AVX2's layout: a prompt's int4 products were wrong there). Each set this CPU runs, in a process of its
    own (ATEN_CPU_CAPABILITY picks it): unpack reads its packing back exactly."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    result = subprocess.run([sys.executable, "-c", UNPACK_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    ran, layout, whole, block = result.stdout.split()
    if ran.lower() != capability:
        pytest.skip(f"this CPU does not run torch's {capability} kernels")
    assert layout == capability and whole == "True" and block == "True", result.stdout


def test_an_int4_prompt_on_a_cpu_with_bf16_instructions_runs_dequantized_blocks(monkeypatch):
    """Where the CPU multiplies bf16, a prompt's int4 product (torch's packing) from MIN_INT4_ROWS rows on runs
    Int4Linear.dequantized_product: blocks of the matrix dequantized to bf16, times oneDNN's bf16 product, within bf16
    rounding of the exact product of the rows and those bf16 weights (the weights torch's kernel multiplies them by);
    fewer rows run torch's kernel."""
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: True)
    generator = torch.Generator().manual_seed(7)
    n, k = BLOCK_ROWS + 2 * PACK_ROWS, 256  # a whole block and a part, in 64-row packing blocks
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=generator) * 0.05
    module = Int4Linear(linear, torch.bfloat16, 32, words=False)
    calls = []
    real = module.dequantized_product
    monkeypatch.setattr(module, "dequantized_product", lambda rows: calls.append(len(rows)) or real(rows))
    x = torch.randn(MIN_INT4_ROWS, k, generator=generator).bfloat16()
    weight = int4.dequantize(int4.unpack(module.weight), module.scales_and_zeros).bfloat16().double()
    with torch.no_grad():
        y = module(x)
        assert calls == [MIN_INT4_ROWS] and y.dtype == torch.bfloat16 and y.shape == (MIN_INT4_ROWS, n)
        error = (y.double() - x.double() @ weight.T).abs().max()
        assert within_rounding(y, x, weight, torch.bfloat16), f"max error {error:.3g}"
        fewer = module(x[:-1])
    assert calls == [MIN_INT4_ROWS], "fewer rows run torch's kernel"
    assert (fewer.double() - y[:-1].double()).abs().max() <= 0.05 * y.double().abs().max(), "the two routes agree"


@pytest.mark.parametrize("layout", sorted(int4.UNPACK))
def test_int4_blocks_dequantize_to_the_same_bits_compiled_and_eager(layout):
    """dequantize_block's stored kernel (a later start's) and its eager run (a first start's, before the kernels are
    stored) give the same bf16 weights, in each of torch's packings: a prompt's tokens do not depend on which start
    it is."""
    generator = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (PACK_ROWS, 128), generator=generator, dtype=torch.uint8)  # 64 rows, K = 256
    scales_and_zeros = (torch.randn(256 // 32, PACK_ROWS, 2, generator=generator) * 0.02).bfloat16()
    eager = int4.dequantize_block(packed, scales_and_zeros, layout=layout)
    compiled = jit_kernel(int4.dequantize_block, [packed, scales_and_zeros], dict(layout=layout))
    assert torch.equal(compiled(packed, scales_and_zeros).view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-words"])
def test_quantized_prompts_run_widened_within_rounding_of_the_dequantized_product(monkeypatch, no_bf16_instructions,
                                                                                   scheme):  # fmt: skip
    """A prompt's int8 or int4 product (Int8Linear, Int4Linear in either layout) runs widened from its threshold
    of rows on (below it, torch's kernel or the words loop), and equals the exact product of the bf16 rows and the
    dequantized matrix within bf16 rounding (torch's int4 kernel, which may round each dequantized weight to bf16
    first, is not held to that)."""
    generator = torch.Generator().manual_seed(5)
    n, k = BLOCK_ROWS + 2 * PACK_ROWS, 256  # a whole block and a part, in 64-row packing blocks
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=generator) * 0.05
    if scheme == "int8":
        module, threshold = Int8Linear(linear, torch.bfloat16), MIN_INT8_ROWS
        weight = dequantized_weight(module).double()
    elif scheme == "int4":
        module, threshold = Int4Linear(linear, torch.bfloat16, 32, words=False), MIN_INT4_ROWS
        weight = int4.dequantize(int4.unpack(module.weight), module.scales_and_zeros).double()
    else:  # widened by its own loop over blocks dequantized transposed, from its own threshold
        module, threshold = Int4Linear(linear, torch.bfloat16, 32, words=True), widen.MIN_INT4_WORDS_ROWS
        weight = int4.dequantize_words(module.weight, module.scales_and_zeros).double()
    calls = count_widened(monkeypatch, "products")
    if scheme == "int4-words":
        real = module.widened_words
        monkeypatch.setattr(module, "widened_words", lambda rows: calls.append(rows) or real(rows))
    x = torch.randn(threshold, k, generator=generator).bfloat16()
    y = module(x)
    assert y.dtype == torch.bfloat16 and y.shape == (threshold, n) and len(calls) == 1
    error = (y.double() - x.double() @ weight.T).abs().max()
    assert within_rounding(y, x, weight, torch.bfloat16), f"max error {error:.3g}"
    assert module(x[:-1]).shape == (threshold - 1, n)
    assert len(calls) == 1, "only the threshold's rows run widened"


def test_a_quantized_prompt_runs_widened_with_the_logits_of_torchs_kernels(tmp_path, monkeypatch, no_bf16_instructions):
    """int8, int4 in torch's packing and int4 in the words layout (int4.py, chosen here on any CPU): a prompt's
    products run widened from their threshold, with the logits of the same model's products below it."""
    path = build_checkpoint(tmp_path, dtype=torch.bfloat16)
    prompt = torch.arange(3, 3 + 24).view(1, -1)
    words = Int4Linear.widened_words
    for scheme in ("int8", "int4", "int4-words"):
        monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "words" if scheme == "int4-words" else "torch")
        model = load_model(path, dtype=torch.bfloat16, optimize="decode", quantize=scheme.removesuffix("-words"))
        threshold = {"int8": "MIN_INT8_ROWS", "int4": "MIN_INT4_ROWS", "int4-words": "MIN_INT4_WORDS_ROWS"}[scheme]
        with torch.no_grad():
            monkeypatch.setattr(widen, threshold, 10**9)
            # the words' rows one at a time, through the one-row kernel built at load: a row's bits do not depend on
            # its block (tests/test_int4.py), and each block size is a kernel per matrix shape to build (~100 s on an
            # empty inductor cache)
            with monkeypatch.context() as one_row:
                one_row.setattr(int4, "ROW_BLOCKS", (1,))
                reference = model(prompt).float()
            monkeypatch.setattr(widen, threshold, 8)
            calls = count_widened(monkeypatch, "products")
            monkeypatch.setattr(Int4Linear, "widened_words", lambda self, rows: calls.append(rows) or words(self, rows))
            ours = model(prompt).float()
        assert len(calls) >= len(model.model.layers) * 4, f"{scheme}: the prompt's products run widened"
        assert (ours.argmax(-1) == reference.argmax(-1)).all(), scheme
        assert (ours - reference).abs().max() <= 0.05 * reference.abs().max(), f"{scheme}: more than rounding apart"
