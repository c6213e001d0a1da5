"""The load-time layouts (compiled one-row products for decode, fused + prepacked matrices for batches,
int8 weights) keep the model's answers: fp32 logits as transformers' to 1e-5, bf16 greedy tokens as
transformers', int8 logits as the model whose matrices are the same int8 weights dequantized. Decode's
one-row products take another path than a prompt's, so each is checked on both. Speed is in scripts/."""

import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint, load_reference
from torch import nn

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.errors import CheckpointError
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch, generate_tokens
from qwen3_scratch.kernels import cpu_decode, quantize, sgemm
from qwen3_scratch.kernels import matvec as matvec_module
from qwen3_scratch.kernels.cpu_decode import CPUDecoderLayer
from qwen3_scratch.kernels.int4_pairs import Int4PairsLinear
from qwen3_scratch.kernels.matvec import MatvecLinear
from qwen3_scratch.kernels.quantize import (
    Int8Linear,
    deinterleave_columns,
    dequantized_weight,
    interleave_columns,
    quantize_rows,
    quantize_rows_chunk,
    use_int8_route,
)
from qwen3_scratch.model.config import Qwen3Config
from qwen3_scratch.model.kv_cache import KVCache, attention_mask
from qwen3_scratch.model.qwen3 import DecoderLayer, one_query_attention
from qwen3_scratch.sampling.logits import LogitsFilter

GREEDY = LogitsFilter(temperature=0.0)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16)


def ids(batch=2, length=48, seed=0):
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def check_layout(model, optimize):
    layer = model.model.layers[0]
    if optimize == "decode":
        assert isinstance(model.lm_head, MatvecLinear) and isinstance(layer.self_attn.q_proj, MatvecLinear)
        return
    assert hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "q_proj"), "q/k/v were not fused"
    assert hasattr(layer.mlp, "gate_up_proj") and not hasattr(layer.mlp, "gate_proj"), "gate/up were not fused"


def decode_logits(model, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Next-token logits (steps, V) for positions prompt_len-1.., the rest fed one token per decode step."""
    loop = CachedLoop(model, PaddedBatch.left_pad([tokens[:prompt_len]], 0, "cpu"), len(tokens) - prompt_len)
    logits = [loop.start()]
    for token in tokens[prompt_len:]:
        logits.append(loop.step(torch.tensor([token])))
    return torch.cat(logits)


@pytest.mark.parametrize("optimize", ["decode", "batch"])
@pytest.mark.parametrize("untied", [False, True])
def test_optimized_fp32_logits_match_transformers_in_prefill_and_decode(tmp_path, tied, untied, optimize):
    path = build_checkpoint(tmp_path, tie_word_embeddings=False) if untied else tied
    model = load_model(path, dtype=torch.float32, optimize=optimize)
    check_layout(model, optimize)
    x = ids(length=80)
    reference = load_reference(path)(x).logits
    assert_logits_match(model(x), reference, f"{optimize} layout, untied={untied}, prefill")
    # 24 one-row steps; the attended slots grow in blocks of 64, so they cross one (masked slots past the end)
    steps = decode_logits(model, x[0].tolist(), prompt_len=56)
    assert_logits_match(steps, reference[0, 55:], f"{optimize} layout, untied={untied}, decode steps")


@pytest.mark.parametrize("optimize", ["decode", "batch"])
def test_optimized_bf16_greedy_tokens_equal_transformers(bf16_checkpoint, optimize):
    model = load_model(bf16_checkpoint, dtype="bfloat16", optimize=optimize)
    check_layout(model, optimize)
    reference = load_reference(bf16_checkpoint, dtype=torch.bfloat16)
    x = ids(batch=4, length=64)
    agree = (model(x).argmax(-1) == reference(x).logits.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"bf16 argmax agrees at only {agree:.1%} of positions (need >= 99%)"
    prompt = ids(1, 12, seed=3)
    ours = torch.cat(list(generate_tokens(model, prompt.tolist(), 16, GREEDY, ignore_eos=True))).tolist()
    theirs = reference.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 12:].tolist()
    assert ours == theirs, f"bf16 greedy tokens differ from transformers' with the {optimize} layout"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 64), (37, 100), (1, 5)])  # rows, cols: tails of the SIMD loop too
def test_compiled_one_row_product_equals_linear(shape, dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    linear = nn.Linear(shape[1], shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    layer = MatvecLinear(linear)
    x = torch.randn(1, 1, shape[1]).to(dtype)
    exact = (x.double() @ weight.double().T).to(dtype)  # one rounding of the exact sum
    ours = layer(x)
    assert ours.shape == (1, 1, shape[0]) and ours.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # fp32 summation order; one bf16 rounding step
    assert torch.allclose(ours.double(), exact.double(), rtol=tolerance, atol=tolerance), "one-row product is wrong"
    rows = torch.randn(1, 3, shape[1]).to(dtype)
    several = sgemm.linear(rows, weight)  # F.linear, or in fp32 where MKL is slow oneDNN's product (sgemm.py)
    assert torch.equal(layer(rows), several), "several rows should take the several-row product's path"


def test_slices_are_one_size_for_the_products_of_one_row_and_about_four():
    """slice_rows for Qwen3-0.6B's products (q, k and v; gate and up; o; down; the lm_head), a larger model's q/k/v
    (Qwen3-4B: 32 and 8 heads), and matrices with few rows: every count a whole number of slices, of whole 8-row
    steps where the count allows it."""
    assert matvec_module.slice_rows(2048, 1024, 1024) == 1024  # four slices: q's two, k's, v's
    assert matvec_module.slice_rows(3072, 3072) == 1536
    assert matvec_module.slice_rows(1024) == 256
    assert matvec_module.slice_rows(151936) == 37984  # 151936 = 2**7 * 1187
    assert matvec_module.slice_rows(4096, 1024, 1024) == 1024  # six slices: no smaller size makes fewer
    assert matvec_module.slice_rows(48) == 24 and matvec_module.slice_rows(37) == 37
    assert matvec_module.slice_rows(8) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(96, 256), (80, 100), (3 * 37, 64)])  # (N, K): whole runs, no whole run, odd rows
def test_a_product_in_slices_gives_one_slices_sums_bit_for_bit(rows, dtype):
    """matvec in slices (compiled, as a decode runs it, and eager) against one slice: each row's sum is the same
    loop over the same numbers wherever its slice starts, so the same bits, also with 3 slices of 37 rows."""
    N, K = rows
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(N, K, generator=g) * torch.logspace(-3, 3, K)).to(dtype)
    x = torch.randn(1, K, generator=g)
    slice_rows = 37 if N == 3 * 37 else matvec_module.slice_rows(N)
    assert slice_rows < N
    one = matvec_module.kernel(matvec_module.matvec, x, weight)(x, weight)
    sliced = matvec_module.kernel(matvec_module.matvec, x, weight, rows=slice_rows)(x, weight)
    assert sliced.dtype == dtype and torch.equal(sliced, one)
    assert torch.equal(matvec_module.matvec(x, weight, slice_rows), matvec_module.matvec(x, weight))


def test_a_product_of_its_own_runs_in_slices():
    """MatvecLinear (the lm_head's product) runs matvec's loop in slice_rows' slices: the kernel it holds is the one
    kernel() keeps for those constants."""
    weight = torch.randn(96, 256).bfloat16()
    linear = nn.Linear(256, 96, bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    layer = MatvecLinear(linear)
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    got = layer(x)
    row = torch.empty(1, 256)
    assert layer.kernel is matvec_module.kernel(matvec_module.matvec, row, weight, rows=matvec_module.slice_rows(96))
    assert torch.equal(got.view(-1), matvec_module.matvec(x.view(1, -1).float(), weight))


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_layers_equal_the_eager_layers(tied, bf16_checkpoint, dtype, quantize, monkeypatch):
    """cpu_decode's two kernels a layer (the products and the ops between them) keep eager's roundings and
    the products' sums: bf16 bit for bit (with the fp32 attention for short contexts off: it is the one part
    that rounds differently); fp32 within the float rounding of fused multiply-adds. With float weights, int8
    ones and int4 ones (torch's int4 kernel called inside the halves, or the words loop on an AVX2 CPU: the same
    kernel as eager's, so equal; the pairs, QWEN3_SCRATCH_INT4_LAYOUT=pairs or unset on AVX2, pass too, and
    tests/test_int4_pairs.py holds their halves to the eager layers)."""
    monkeypatch.setattr(cpu_decode, "SHORT_CONTEXT", 0)
    monkeypatch.setattr(cpu_decode, "FLASH_ATTENTION", False)
    monkeypatch.setattr(cpu_decode, "ONE_ROW_KERNEL", False)
    model = load_model(bf16_checkpoint if dtype == torch.bfloat16 else tied, dtype=dtype, optimize="decode",
                       quantize=quantize)  # fmt: skip
    assert all(type(layer) is CPUDecoderLayer for layer in model.model.layers)
    tokens = ids(1, 40, seed=5)[0].tolist()
    fast = decode_logits(model, tokens, prompt_len=20).float()
    scheme = model.model.layers[0].whole_halves()  # int4: "int4-pairs" where int4_pairs.holds, "int4-words" if asked
    assert scheme in ((quantize or "float"), f"{quantize}-words", f"{quantize}-pairs")
    assert (scheme == "int4-pairs") is isinstance(model.lm_head, Int4PairsLinear)  # (the suite's int4: torch's)
    halves = set(cpu_decode.HALVES[scheme])
    assert all(halves <= layer._kernels.keys() for layer in model.model.layers), "a layer is not its two kernels"
    steps = [layer.__dict__.get("_step") for layer in model.model.layers]  # the steps after each layer's first
    assert all(isinstance(step, cpu_decode.HalvesStep) for step in steps), "a layer's later steps looked its kernels up"
    for layer in model.model.layers:
        layer.__class__ = DecoderLayer
    eager = decode_logits(model, tokens, prompt_len=20).float()
    if dtype == torch.bfloat16:
        assert torch.equal(fast, eager), "bf16 decode logits differ between the compiled and the eager layers"
    else:
        worst = ((fast - eager).abs().max() / eager.abs().max()).item()
        assert worst < 1e-6, f"fp32 decode logits differ by {worst:.2g} of the largest"


@pytest.mark.parametrize("flash", [False, True], ids=["fp32-attention", "flash-attention"])
def test_decode_attention_keeps_bf16_decode_within_the_parity_bounds(bf16_checkpoint, flash, monkeypatch):
    """In bf16 the compiled layers attend in fp32 while the context is short, or with SDPA's flash kernel
    (on a CPU with AMX): not bit-identical to the eager layers (scores are not rounded to bf16), but the
    same greedy choices and logits within bf16's rounding; transformers' greedy tokens are checked by
    test_optimized_bf16_greedy_tokens_equal_transformers (with whichever attention this CPU picks)."""
    monkeypatch.setattr(cpu_decode, "FLASH_ATTENTION", flash)
    monkeypatch.setattr(cpu_decode, "ONE_ROW_KERNEL", False)  # its own test: test_one_row_attention.py
    model = load_model(bf16_checkpoint, dtype=torch.bfloat16, optimize="decode")
    tokens = ids(1, 60, seed=6)[0].tolist()
    fast = decode_logits(model, tokens, prompt_len=20).float()  # 40 steps, 20 to 60 slots: fp32 attention
    assert_within_bf16_bounds_of_the_eager_layers(model, tokens, fast, f"{'flash' if flash else 'fp32'} attention")


def assert_within_bf16_bounds_of_the_eager_layers(model, tokens: list[int], fast: torch.Tensor, what: str) -> None:
    """fast: decode_logits(model, tokens, prompt_len=20) by the compiled layers. The eager layers' (the model's own
    class put back) must agree in >= 99% of greedy choices, logits within 2% of the largest."""
    for layer in model.model.layers:
        layer.__class__ = DecoderLayer
    eager = decode_logits(model, tokens, prompt_len=20).float()
    agree = (fast.argmax(-1) == eager.argmax(-1)).float().mean().item()
    worst = ((fast - eager).abs().max() / eager.abs().max()).item()
    assert agree >= 0.99 and worst < 0.02, f"{what}: argmax agreement {agree:.1%}, max relative diff {worst:.3g}"


@pytest.mark.parametrize("slots", [64, 192])
def test_flash_decode_attention_equals_fp32_attention_within_bf16_rounding(slots):
    """attend_flash (SDPA's kernel on the bf16 cache) against attend_in_fp32 on the same cache, with the
    new token written at a slot inside the block and the slots past it masked, as a decode step has them."""
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=1)
    attn = type("Attn", (), dict(layer_index=0, n_heads=4, head_dim=32))()
    g = torch.Generator().manual_seed(slots)
    cache = KVCache(config, 1, slots + 16, dtype=torch.bfloat16)
    cache.keys.normal_(generator=g), cache.values.normal_(generator=g)
    slot = torch.tensor([slots - 9])
    mask = attention_mask(slot, cache.key_valid)[..., :slots]  # (1, 1, 1, slots): 8 slots past the token masked
    q, k, v = (torch.randn(1, h, 1, 32, generator=g).bfloat16() for h in (4, 2, 2))
    flash = cpu_decode.attend_flash(attn, q, k, v, mask, cache, slot).float()
    fp32 = cpu_decode.attend_in_fp32(attn, q, k, v, mask, cache, slot).float()
    assert flash.shape == (1, 1, 128), f"flash attention's output has shape {tuple(flash.shape)}"
    worst = (flash - fp32).abs().max().item()
    assert worst < 2**-6, f"flash attention differs from fp32 attention by {worst:.3g} (bf16 rounding is ~{2**-8})"
    cache.values[0, :, :, slots - 8 :] = 1e4  # the masked slots must not count
    assert torch.equal(cpu_decode.attend_flash(attn, q, k, v, mask, cache, slot).float(), flash), "masked slots were attended"


@pytest.mark.parametrize("slots", [5, 64, 200])
def test_fp32_decode_attention_equals_the_models_one_query_attention_on_the_widened_cache(slots):
    """attend_in_fp32 (SDPA's fp32 kernel) against one_query_attention (the model's two products and softmax) over
    the same widened keys and values, the slots past the token masked: equal within fp32 rounding before the
    cast to bf16, so within bf16 rounding after it."""
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=1)
    attn = type("Attn", (), dict(layer_index=0, n_heads=4, head_dim=32))()
    g = torch.Generator().manual_seed(slots)
    cache = KVCache(config, 1, slots + 16, dtype=torch.bfloat16)
    cache.keys.normal_(generator=g), cache.values.normal_(generator=g)
    slot = torch.tensor([slots - 1 - min(8, slots - 1)])
    mask = attention_mask(slot, cache.key_valid)[..., :slots]  # (1, 1, 1, slots), the slots past the token masked
    q, k, v = (torch.randn(1, h, 1, 32, generator=g).bfloat16() for h in (4, 2, 2))
    got = cpu_decode.attend_in_fp32(attn, q, k, v, mask, cache, slot).float().view(4, 32)
    keys, values = cache.keys[0, :, :, :slots].float(), cache.values[0, :, :, :slots].float()  # layer 0, k and v written
    want = one_query_attention(q.float(), keys, values, mask).view(4, 32)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7, msg="fp32 attention vs the model's one-query maths")


def test_decode_layout_falls_back_to_the_packed_one_when_inductor_cannot_build(tied, monkeypatch):
    monkeypatch.setattr(matvec_module, "unavailable_reason", lambda: "InvalidCxxCompiler: no working C++ compiler")
    with pytest.warns(UserWarning, match="compiled CPU decode kernels are unavailable .*InvalidCxxCompiler"):
        model = load_model(tied, dtype=torch.float32, optimize="decode")
    check_layout(model, "batch")
    x = ids()
    assert_logits_match(model(x), load_reference(tied)(x).logits, "fallback layout")


def test_unknown_layout_is_refused(tied):
    with pytest.raises(ValueError, match="optimize='fast': use one of"):
        load_model(tied, optimize="fast")


def test_optimized_loading_still_checks_every_checkpoint_key(tmp_path):
    """Fusion happens after the strict load, so a missing matrix is named as the checkpoint names it."""
    from safetensors.torch import load_file, save_file

    path = build_checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no tensor model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, optimize="decode", quantize="int8")


def dequantized_reference(path, dtype):
    """The plain model with each matrix replaced by its int8 weights times their scales."""
    model = load_model(path, dtype=dtype)
    for module in model.modules():
        if type(module) is nn.Linear:
            q, scales = quantize_rows(module.weight)
            module.weight = nn.Parameter((q.float() * scales[:, None]).to(dtype), requires_grad=False)
    return model


@pytest.mark.parametrize("words", [False, True], ids=["codes-in-rows", "codes-as-words"])
@pytest.mark.parametrize("optimize", [None, "decode"])
def test_int8_logits_equal_the_dequantized_weights_reference(tied, optimize, words, monkeypatch):
    """Either layout of the codes (words: the one-row loop's on an AVX2 CPU, chosen here on any CPU), prefill by
    torch's int8 kernel and decode by the compiled loops (with optimize="decode", inside each layer's halves)."""
    monkeypatch.setattr(quantize, "cpu_reads_int8_as_words", lambda: words)
    model = load_model(tied, dtype=torch.float32, quantize="int8", optimize=optimize)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.weight.dtype == torch.int8
    assert model.lm_head.words is words and model.model.layers[0].mlp.down_proj.words is words
    assert model.lm_head.kernel is not None, "one-row int8 products should run the compiled loop here"
    assert model.model.embed_tokens.weight.dtype == torch.float32, "the embedding lookup stays unquantized"
    x = ids()
    reference = dequantized_reference(tied, torch.float32)(x)
    assert_logits_match(model(x), reference, f"int8, optimize={optimize}, prefill")
    steps = decode_logits(model, x[0].tolist(), prompt_len=40)
    assert_logits_match(steps, reference[0, 39:], f"int8, optimize={optimize}, decode steps")


def test_int8_rows_round_trip_within_half_a_step():
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]  # rows of very different ranges
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127, "the largest |w| of each row must map to 127"
    error = (dequantized_weight_of(q, scales) - w).abs()
    assert (error <= scales[:, None] / 2 + 1e-6).all(), "rounding error above half a quantization step"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_quantizing_compiled_or_eager_gives_the_same_codes_in_either_layout(dtype):
    """quantize_rows (eager until its kernel is stored, as in this suite) and the compiled loop a later start loads
    (quantize_rows_chunk), in either layout: the same codes and scales, bit for bit (the words: interleave_columns
    of the row-order codes), with a zero row, rows at +-127 and every code from -127 to 127."""
    torch.manual_seed(0)
    w = (torch.randn(200, 96) * torch.logspace(-3, 1, 200)[:, None]).to(dtype)
    w[4], w[7, 5], w[8, 9] = 0, -50.0, 50.0
    want, want_scales = quantize_rows(w, rows_per_chunk=64)
    assert want[7].min() == -127 and want[8].max() == 127 and want[4].abs().max() == 0
    assert len(want.unique()) == 255, "every code from -127 to 127"
    got, scales = quantize_rows(w, rows_per_chunk=64, words=True)
    assert torch.equal(got, interleave_columns(want)) and torch.equal(scales, want_scales)
    chunk = w.float()
    for words, codes in ((False, want), (True, interleave_columns(want))):
        got, scales = matvec_module.kernel(quantize_rows_chunk, chunk, words=words)(chunk)
        assert torch.equal(got.view(torch.int8), codes) and torch.equal(scales, want_scales), f"words={words}"


def dequantized_weight_of(q, scales):
    layer = Int8Linear(nn.Linear(q.shape[1], q.shape[0], bias=False), torch.float32, words=False)  # codes in row order
    layer.weight.data, layer.scales.data = q, scales
    return dequantized_weight(layer)


def test_interleaved_columns_put_one_column_of_each_quarter_in_every_word():
    K = 64
    order = interleave_columns(torch.arange(K)[None])[0]
    assert order[:8].tolist() == [0, 16, 32, 48, 1, 17, 33, 49], "word j should hold columns j, j+K/4, j+K/2, j+3K/4"
    t = torch.randn(3, 5, K)
    assert torch.equal(deinterleave_columns(interleave_columns(t)), t)


def test_the_one_row_int8_loop_over_words_gives_the_row_orders_products():
    """matvec_int8_words (compiled, as it runs) against matvec_int8 on the same codes in the rows' order: codes over
    the whole int8 range, both signs of each byte position, fp32 and bf16 scales; eager too. The same products
    summed in another order: equal to fp32 rounding."""
    g = torch.Generator().manual_seed(3)
    N, K = 40, 256
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    codes[0], codes[1] = 127, -127  # every byte of a word at either end of the range
    x = torch.randn(1, K, generator=g)
    words = interleave_columns(codes).view(torch.float32)  # (N, K/4): four codes a word
    for scales in (torch.rand(N, generator=g) + 0.5, (torch.rand(N, generator=g) + 0.5).bfloat16()):
        want = matvec_module.matvec_int8(x, codes, scales).float()
        got = matvec_module.kernel(matvec_module.matvec_int8_words, x, words, scales)(x, words, scales).float()
        assert got.dtype == want.dtype and got.shape == (N,)
        rtol = 1e-5 if scales.dtype == torch.float32 else 2**-7  # bf16: one rounding of sums equal to fp32's
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-3)
        eager = matvec_module.matvec_int8_words(x, words, scales).float()  # some words' bits are NaNs as floats
        torch.testing.assert_close(eager, want, rtol=rtol, atol=1e-3)
        # in two slices (a whole-half kernel's): the same bits as one
        sliced = matvec_module.kernel(matvec_module.matvec_int8_words, x, words, scales, rows=N // 2)
        assert torch.equal(sliced(x, words, scales).float(), got)


def test_an_int8_layer_with_codes_as_words_multiplies_as_one_in_the_rows_order():
    """One row by the words loop, several by torch's int8 kernel over interleaved activations, the dequantized
    matrix and the GPU routes (which read the rows' order): all as the layer whose codes keep the rows' order."""
    linear = nn.Linear(128, 48, bias=False)
    words, rows = Int8Linear(linear, torch.float32, words=True), Int8Linear(linear, torch.float32, words=False)
    assert words.words and not rows.words and words.codes.shape == (48, 32) and words.codes.dtype == torch.float32
    assert torch.equal(dequantized_weight(words), dequantized_weight(rows))
    x = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(words(x[:, :1]), rows(x[:, :1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(words(x), rows(x), rtol=1e-5, atol=1e-5)
    use_int8_route(words, "fused-cast")
    use_int8_route(rows, "fused-cast")
    assert not words.words and torch.equal(words.weight, rows.weight), "another route should get the rows' order back"
    assert torch.equal(words(x), rows(x))


def test_int8_against_bf16_argmax_agreement(bf16_checkpoint):
    """What int8 costs in accuracy on the tiny checkpoint (the 0.6B figures are in docs/performance.md)."""
    x = ids(batch=4, length=64)
    bf16 = load_model(bf16_checkpoint, dtype="bfloat16", optimize="decode")(x).float()
    int8 = load_model(bf16_checkpoint, dtype="bfloat16", optimize="decode", quantize="int8")(x).float()
    agree = (bf16.argmax(-1) == int8.argmax(-1)).float().mean().item()
    worst = ((int8 - bf16).abs().max() / bf16.abs().max()).item()
    print(f"int8 vs bf16 on the tiny checkpoint: argmax agreement {agree:.1%}, max relative logit diff {worst:.3g}")
    assert agree >= 0.95, f"int8 argmax agrees with bf16 at only {agree:.1%} of positions"
    assert worst < 0.05, f"int8 logits differ from bf16 by {worst:.3g} of the largest logit"


def test_unknown_quantization_is_refused_before_loading(tied):
    with pytest.raises(CheckpointError, match="--quantize 'int2' is not supported; use one of int8, int4"):
        load_model(tied, quantize="int2")
