"""int4 weights (kernels/int4.py) compute what they claim: the model whose matrices are the same int4 codes
dequantized, to the suite's fp32 bar, in a prompt and in decode steps; and they load, generate, chat and
serve through every entry point (CLI, chat, LLM, the server). Speed is in scripts/bench/benchmark_decode.py."""

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from checkpoints import assert_logits_match, build_checkpoint
from cli_helpers import assert_one_line_error, cli
from make_tiny_checkpoint import make_tiny_checkpoint
from openai_server import uvicorn_thread
from torch import nn

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.cli.serve import build_parser as serve_parser
from qwen3_scratch.cli.serve import load as serve_load
from qwen3_scratch.errors import CheckpointError
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch, generate_tokens
from qwen3_scratch.kernels import int4, matvec, widen
from qwen3_scratch.kernels.int4 import Int4Linear, dequantize, quantize_groups
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.server.app import build_app
from qwen3_scratch.server.async_engine import AsyncEngine

GREEDY = LogitsFilter(temperature=0.0)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("int4"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int4-cli") / "tiny-qwen3")


def dequantized_reference(path, dtype, group_size):
    """The plain fp32 model with each matrix replaced by its int4 codes dequantized (scales and zero points
    rounded to `dtype`, as the int4 layers keep them): what the int4 products must equal."""
    model = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if type(module) is nn.Linear:
                codes, scales_and_zeros = quantize_groups(module.weight, group_size)
                module.weight = nn.Parameter(dequantize(codes, scales_and_zeros.to(dtype)), requires_grad=False)
    return model


def prompt_and_steps(model, tokens, prompt_len):
    """Next-token logits (steps, V) for positions prompt_len-1.., the rest fed one token per decode step."""
    loop = CachedLoop(model, PaddedBatch.left_pad([tokens[:prompt_len]], 0, "cpu"), len(tokens) - prompt_len)
    logits = [loop.start()]
    for token in tokens[prompt_len:]:
        logits.append(loop.step(torch.tensor([token])))
    return torch.cat(logits)


@pytest.mark.parametrize(("optimize", "words"), [(None, False), ("decode", False), ("batch", False),
                                                ("decode", True), ("batch", True)])  # fmt: skip
def test_int4_fp32_logits_equal_the_dequantized_weights_reference(tied, optimize, words, monkeypatch):
    """Either layout of the nibbles (words: an AVX2 CPU's, chosen here on any CPU), in a prompt (words: blocks of
    rows through its loop) and in decode steps (with optimize="decode", inside each layer's halves). The words in
    the fused layouts only: unfused, every matrix of a layer is a shape of its own to compile, for no other path."""
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "words" if words else "torch")
    model = load_model(tied, dtype=torch.float32, quantize="int4", optimize=optimize)
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.words is words
    assert model.lm_head.weight.dtype == (torch.int32 if words else torch.uint8)
    assert model.model.embed_tokens.weight.dtype == torch.float32, "the embedding lookup stays unquantized"
    reference = dequantized_reference(tied, torch.float32, 32)
    x = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = reference(x)
    assert_logits_match(model(x), expected, f"int4, optimize={optimize}, prefill")
    tokens = x[0].tolist()
    # a prompt of whole blocks of 8 rows: the words' smaller blocks are checked on their own below (each block size
    # is a kernel per matrix shape to build: ~100 s more of this test on an empty inductor cache)
    assert_logits_match(prompt_and_steps(model, tokens, 32), expected[0, 31:], f"int4, optimize={optimize}, decode steps")


def test_int4_bf16_logits_stay_within_bf16_rounding_of_the_reference(tmp_path):
    """With bf16 activations (the fast path on a CPU) the same products, rounded to bf16 along the way;
    group 64 here, on a checkpoint whose every matrix it divides."""
    path = build_checkpoint(tmp_path, intermediate_size=192)
    model = load_model(path, dtype=torch.bfloat16, quantize="int4", quantize_group_size=64, optimize="decode")
    reference = dequantized_reference(path, torch.bfloat16, 64)
    x = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    ours, theirs = model(x).float(), reference(x)
    worst = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert worst < 0.06, f"bf16 int4 logits differ from the fp32 dequantized reference by {worst:.3g} of the largest"


def test_int4_linear_takes_a_strided_view_as_its_input():
    """Generation asks for the last position's logits only, x[:, -1:] of (B, T, C): not contiguous."""
    layer = Int4Linear(nn.Linear(128, 64, bias=False), torch.bfloat16, group_size=32)
    x = torch.randn(3, 5, 128, dtype=torch.bfloat16)
    assert torch.equal(layer(x[:, -1:]), layer(x[:, -1:].contiguous())), "a strided input changed the result"


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_words_give_the_dequantized_matrix_product_at_any_number_of_rows(group_size):
    """The words layout (on any CPU here): its nibbles unpack to the codes torch's layout holds; one row, a few (in
    blocks of 8, 4, 2 and 1 rows) and MIN_INT4_WORDS_ROWS bf16 rows (widened: a block of the matrix at a time,
    dequantized transposed) each equal the fp64 product of the dequantized matrix to fp32 rounding, bf16 rows
    within bf16 rounding of it."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 2 * int4.ROWS * 9, bias=False)  # 144 rows: not a multiple of torch's 64
    words = Int4Linear(linear, torch.float32, group_size, words=True)
    assert words.words and words.weight.shape == (18, 32, int4.ROWS) and words.weight.dtype == torch.int32
    codes, scales_and_zeros = quantize_groups(linear.weight.detach(), group_size)
    assert torch.equal(int4.unpack_words(words.weight), codes.to(torch.uint8))
    matrix = dequantize(codes, scales_and_zeros)
    assert torch.equal(int4.dequantize_words(words.weight, words.scales_and_zeros), matrix)
    transposed = int4.dequantize_words_transposed(words.codes, words.scales_and_zeros, int4.SHIFTS)
    assert torch.equal(transposed, matrix.t()), "the widened product's blocks"
    for rows in (1, 3, 13):
        x = torch.randn(rows, 256)
        exact = x.double() @ matrix.double().t()
        worst = ((words(x).double() - exact).abs().max() / exact.abs().max()).item()
        assert worst < 1e-5, f"{rows} rows: {worst:.1e} of the largest output"
    half = Int4Linear(linear, torch.bfloat16, group_size, words=True)
    exact_half = dequantize(codes, scales_and_zeros.bfloat16()).double().t()
    for rows in (3, widen.MIN_INT4_WORDS_ROWS):
        x = torch.randn(rows, 256).bfloat16()
        exact = x.double() @ exact_half
        assert ((half(x).double() - exact).abs().max() / exact.abs().max()).item() < 2**-7, f"{rows} rows"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantizing_loops_compiled_or_eager_give_the_references_bits(dtype):
    """quantize_and_pack (eager until its kernels are stored, as in this suite) and the compiled loops a later start
    loads (quantize_codes, pack_words_chunk) against the eager reference (quantize_groups, pack_words, words_scales;
    torch's packing of the same codes): equal bits, in chunks with a remainder, with a constant group, a zero group
    and weights of several magnitudes."""
    torch.manual_seed(0)
    w = (torch.randn(200, 96) * torch.logspace(-4, 1, 200)[:, None]).to(dtype)  # 200 rows: chunks of 64, then 8
    w[3, :32], w[9, 32:64] = 0.5, 0.0
    codes, scales_and_zeros = quantize_groups(w, 32)
    words, words_sz = int4.quantize_and_pack(w, 32, rows_per_chunk=64, words=True)
    assert torch.equal(words, int4.pack_words(codes)) and torch.equal(words_sz, int4.words_scales(scales_and_zeros))
    packed, sz = int4.quantize_and_pack(w[:192], 32, rows_per_chunk=64)
    assert torch.equal(packed, int4.pack(codes[:192])) and torch.equal(sz, scales_and_zeros[:, :192])
    chunk = w[:72].contiguous()
    got_codes, got_sz = matvec.kernel(int4.quantize_codes, chunk, group_size=32)(chunk)
    assert torch.equal(got_codes, codes[:72].float()) and torch.equal(got_sz, scales_and_zeros[:, :72])
    got_words, got_words_sz = matvec.kernel(int4.pack_words_chunk, got_codes, got_sz)(got_codes, got_sz)
    assert torch.equal(got_words, int4.pack_words(codes[:72]))
    assert torch.equal(got_words_sz, int4.words_scales(scales_and_zeros[:, :72]))


def test_the_int4_layout_follows_the_cpu_unless_the_environment_names_one(monkeypatch):
    """QWEN3_SCRATCH_INT4_LAYOUT=words or =torch decides; unset, the CPU does (AVX2 only: words); anything else is
    ignored with a warning that names the variable."""
    monkeypatch.setattr(int4, "cpu_reads_words", lambda: True)
    monkeypatch.delenv("QWEN3_SCRATCH_INT4_LAYOUT")
    assert int4.words_by_default()
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "torch")
    assert not int4.words_by_default()
    assert not Int4Linear(nn.Linear(64, 16, bias=False), torch.float32, 32).words
    monkeypatch.setattr(int4, "cpu_reads_words", lambda: False)
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", " Words ")
    assert int4.words_by_default()
    monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", "nibbles")
    with pytest.warns(UserWarning, match="QWEN3_SCRATCH_INT4_LAYOUT='nibbles' is not one of words, pairs, torch"):
        assert not int4.words_by_default()


def test_an_int4_words_row_gives_the_same_bits_alone_or_among_other_rows():
    """Each row's sums are the same expression in every block size (int4.words_product), so a row's output does not
    depend on how many rows came with it: an engine's request decodes alike alone or in a batch. (The shape of the
    test above: its kernels are shared.)"""
    torch.manual_seed(1)
    layer = Int4Linear(nn.Linear(256, 2 * int4.ROWS * 9, bias=False), torch.float32, 32, words=True)
    x = torch.randn(15, 256)  # blocks of 8, 4, 2 and 1
    together = layer(x)
    for i in range(15):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1]), f"row {i}"
    assert torch.equal(layer(x[3:9]), together[3:9]), "rows 3-8 as blocks of 4 and 2"
    assert layer(x[:0]).shape == (0, layer.out_features), "no rows"


def shifted_words_product(x, words, scales_and_zeros):
    """int4.words_product as first written: each nibble shifted down to its value, the scales widened with .float()."""
    R, K = x.shape
    M, G = scales_and_zeros.shape[:2]
    g = K // G
    bits = words.view(torch.int32).view(M, G, g // 8, int4.ROWS)
    columns = x.view(R, G, g // 8, 8)
    scale, zero = scales_and_zeros[..., 0].float(), scales_and_zeros[..., 1].float()
    sums = [sum((((bits >> (4 * b)) & 15).float() * columns[r, :, :, b].view(G, g // 8, 1)).sum(2) for b in range(8))
            for r in range(R)]  # fmt: skip
    x_sums = x.view(R, G, g).sum(-1)
    return torch.stack([(s * scale + (zero - 8 * scale) * x_sums[r].view(1, G, 1)).sum(1).view(-1)
                        for r, s in enumerate(sums)]).to(scales_and_zeros.dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_words_loop_reads_nibbles_and_scales_in_place_with_the_bits_of_unpacking_them(dtype):
    """words_product reads nibble b where it lies (q * 16**b, its sums times 16**-b) and, in bf16, a lane's scale and
    zero as one 32-bit word whose halves it moves into place. Run eagerly (each op rounded as written), it gives the
    bits of the loop that shifts each nibble down and widens each scale with .float(): a power of two rounds
    nothing. Activations over forty orders of magnitude, every code, nibble 7's sign bit included."""
    torch.manual_seed(2)
    layer = Int4Linear(nn.Linear(256, 4 * int4.ROWS, bias=False), dtype, 32, words=True)
    assert layer.scales_and_zeros.shape == (4, 8, int4.ROWS, 2)
    assert {int(c) for c in int4.unpack_words(layer.weight).unique()} == set(range(16))
    x = torch.randn(3, 256) * 10.0 ** torch.randint(-20, 20, (3, 256))
    want = shifted_words_product(x, layer.codes, layer.scales_and_zeros)
    assert torch.equal(int4.words_product(x, layer.codes, layer.scale_words), want)


def test_bf16_scale_and_zero_pairs_widen_to_their_float_values_eagerly_and_compiled():
    """words_scale_and_zero's bit moves give .float() of every bf16 number but NaN, in either half of the word (the
    pairs viewed as float32 words, eagerly and compiled; the pairs themselves, eagerly)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[~values.isnan()]
    n = len(values) // int4.ROWS * int4.ROWS  # (the few left over from one half are in the other)
    pairs = torch.stack([values[:n], values.flip(0)[:n]], dim=-1).view(-1, 1, int4.ROWS, 2)  # (M, 1, 8, 2)
    want = (pairs[..., 0].float(), pairs[..., 1].float())
    words = pairs.view(torch.float32)  # as Int4Linear.scale_words hands them over
    compiled = matvec.kernel(int4.words_scale_and_zero, words)
    for got in (int4.words_scale_and_zero(words), compiled(words), int4.words_scale_and_zero(pairs)):
        assert all(torch.equal(g, w) for g, w in zip(got, want)), "a bf16 scale or zero widened to another number"


def test_int4_groups_round_trip_within_half_a_step():
    w = torch.randn(96, 128) * torch.linspace(0.01, 3, 128)  # groups of very different ranges
    codes, scales_and_zeros = quantize_groups(w, 32)
    assert codes.min() == 0 and codes.max() == 15, "each group's min and max must map to codes 0 and 15"
    step = scales_and_zeros[..., 0].t().repeat_interleave(32, dim=1)  # (N, K): each weight's group scale
    error = (dequantize(codes, scales_and_zeros) - w).abs()
    assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all(), "a weight rounded to more than half a step away"


def test_a_group_size_that_does_not_divide_a_matrix_is_refused_naming_it(tied):
    with pytest.raises(CheckpointError, match=r"--quantize-group-size 64 does not divide the 160 inputs of model\.layers\.0\.mlp\.down_proj"):
        load_model(tied, quantize="int4", quantize_group_size=64)
    with pytest.raises(CheckpointError, match="--quantize-group-size applies to --quantize int4 only"):
        load_model(tied, quantize="int8", quantize_group_size=32)


def test_quantize_int4_generates_from_the_cli_and_misused_flags_fail_in_one_line(tiny, capsys):
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos",
                       "--temperature", "0", "--quantize", "int4", "--show-stats")  # fmt: skip
    assert code == 0, err
    pairs = dict(item.split("=", 1) for item in err.strip().splitlines()[-1].split())
    assert pairs["generated_tokens"] == "6" and pairs["dtype"] == "int4", "int4 must load and generate"
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--quantize-group-size", "64")
    assert_one_line_error(code, err, "--quantize-group-size applies to --quantize int4 only")


def test_chat_answers_with_int4_weights(tiny):
    result = subprocess.run(
        [sys.executable, "-m", "qwen3_scratch.chat", "--model", str(tiny), "--max-new-tokens", "5", "--ignore-eos",
         "--temperature", "0", "--quantize", "int4", "--quantize-group-size", "32"],
        input="Hello!\n/stats\n", capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0 and "generated_tokens=5" in result.stdout, result.stdout + result.stderr


def test_llm_and_server_with_int4_answer_as_the_simple_loop(tiny):
    """qwen3-serve --quantize int4 loads an int4 LLM (serving's layout); LLM.generate and a completion over
    HTTP, from the real openai client, give the simple loop's greedy text on the same int4 model."""
    llm = serve_load(serve_parser().parse_args(["--model", str(tiny), "--quantize", "int4", "--num-blocks", "64"]))
    assert isinstance(llm.model.lm_head, Int4Linear)
    prompt = "def greet(name"
    alone = [int(t[0]) for t in generate_tokens(llm.model, [llm.tokenizer.encode(prompt)], 8, GREEDY, llm.eos_ids)]
    expected = llm.tokenizer.decode(alone, skip_special_tokens=True)
    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert offline.token_ids == alone, "LLM.generate with int4 weights differs from the simple loop"
    engine = AsyncEngine(llm.engine).start()
    app = build_app(engine, llm.tokenizer, "tiny", llm.get_default_sampling_params())
    try:
        with uvicorn_thread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    finally:
        engine.stop()
    assert reply.choices[0].text == expected, "the int4 server's completion differs from the simple loop"
