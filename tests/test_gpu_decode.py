"""kernels/gpu_decode.py: a decode step's glue as four compiled kernels a layer, the GPU's default ("decode"
layout). Its logic is tested on a CPU, where inductor compiles the same functions to C++: the greedy tokens of
the CUDA graph runner (the CPU stand-in) and of batched decode equal the plain layers', fp32 and bf16, dense and
MoE; the pointwise kernels are the eager ops bit for bit; a prefill runs the plain layer; a compiler that fails
leaves the model as it was. On a GPU: the "decode" layout puts it in place and keeps the tokens."""

import logging

import pytest
import torch
from checkpoints import build_checkpoint, build_moe_checkpoint

from qwen3_scratch import load_model
from qwen3_scratch.engine import paged_attention
from qwen3_scratch.engine.engine import LLMEngine
from qwen3_scratch.generation.cuda_graph import forget_graphs
from qwen3_scratch.generation.loops import PaddedBatch, decode_step, generate_tokens, prefill
from qwen3_scratch.kernels import gpu_decode, matvec
from qwen3_scratch.kernels.gpu_decode import GPUDecoderLayer, swiglu, use_gpu_decoder_layers
from qwen3_scratch.kernels.matvec import kernel
from qwen3_scratch.model.kv_cache import KVCache
from qwen3_scratch.model.qwen3 import DecoderLayer
from qwen3_scratch.model.rope import apply_rope
from qwen3_scratch.sampling.logits import LogitsFilter
from qwen3_scratch.sampling.params import SamplingParams

GREEDY = LogitsFilter(temperature=0.0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[5, 9, 200, 31, 7, 77, 4], [300, 12, 8, 150, 2, 2, 60, 61, 19, 400, 33, 5]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("glue"))


def greedy(model, prompts, n=12, cuda_graphs=True):
    steps = generate_tokens(model, prompts, n, GREEDY, ignore_eos=True, cuda_graphs=cuda_graphs)
    return torch.stack(list(steps), dim=1).tolist()  # (B, n)


def plain(model):
    """The model's layers back to plain DecoderLayers, and the graphs captured over the glue dropped."""
    for layer in model.model.layers:
        if type(layer) is GPUDecoderLayer:
            layer.__class__ = DecoderLayer
    forget_graphs(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_glue_kernels_give_the_plain_layers_tokens(checkpoint, dtype):
    model = load_model(checkpoint, dtype=dtype)  # the checkpoint's layout: plain DecoderLayers
    expected_one = [greedy(model, [p])[0] for p in PROMPTS]
    expected_batch = greedy(model, PROMPTS, cuda_graphs=False)  # two rows, eager steps
    assert use_gpu_decoder_layers(model), "inductor builds C++ kernels on this CPU"
    assert all(type(layer) is GPUDecoderLayer for layer in model.model.layers)
    assert [greedy(model, [p])[0] for p in PROMPTS] == expected_one, f"{dtype}: one row, the graph runner"
    assert greedy(model, PROMPTS, cuda_graphs=False) == expected_batch, f"{dtype}: two rows"


def step_logits(model, prompt):
    """The logits of a one-token step (B rows) after a prefill of the rest of each prompt, through a KV cache."""
    ids = torch.tensor(prompt)  # (B, T)
    B, T = ids.shape
    cache = KVCache(model.config, B, T, model.device, model.activation_dtype)
    positions = torch.arange(T).expand(B, T)
    prefill(model, PaddedBatch(ids[:, :-1], torch.ones(B, T - 1, dtype=torch.bool), positions[:, :-1]), cache)
    cache.key_valid[:, T - 1] = True
    return decode_step(model, ids[:, -1:], positions[:, -1:], cache, torch.tensor([T - 1]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_steps_logits_are_the_plain_layers_within_rounding(checkpoint, dtype):
    """Tokens alone would miss a wrong kernel: the tiny model's layers move its logits little. fp32 agrees to
    rounding; in bf16 the only difference allowed is a norm's last bit, once in a great many elements."""
    model = load_model(checkpoint, dtype=dtype)
    rows = [PROMPTS[1][:7], PROMPTS[0]]
    expected = step_logits(model, rows)
    use_gpu_decoder_layers(model)
    got = step_logits(model, rows)
    if dtype == "float32":
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert (got != expected).float().mean() < 0.01, "bf16: more than a rare last-bit difference"
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)


def test_a_decode_step_runs_the_glue_and_a_prefill_the_plain_layer(checkpoint):
    model = load_model(checkpoint, dtype="bfloat16")
    use_gpu_decoder_layers(model)
    calls = []
    real = gpu_decode.kernel
    gpu_decode.kernel = lambda fn, *a, **k: calls.append((fn.__name__, a[0].shape[1])) or real(fn, *a, **k)
    try:
        greedy(model, [PROMPTS[1]], n=2)
    finally:
        gpu_decode.kernel = real
    layers = model.config.num_hidden_layers
    assert {name for name, _ in calls} == {"norm", "heads", "residual_norm", "swiglu"}
    assert all(tokens == 1 for _, tokens in calls), "a prompt of 12 tokens ran through the plain layer"
    assert len(calls) == 4 * layers, "one decode step (the second token), four kernels a layer"


def test_the_pointwise_kernels_are_the_eager_ops_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(1, 1, 96, generator=g) * 3).bfloat16()
    assert torch.equal(kernel(swiglu, gate_up)(gate_up), swiglu(gate_up)), "bf16 roundings as eager's"
    x = (torch.randn(1, 4, 1, 32, generator=g) * 3).bfloat16()
    cos, sin = (torch.randn(1, 1, 32, generator=g).bfloat16() for _ in range(2))

    def rope(x, cos, sin):
        return apply_rope(x, cos, sin)

    assert torch.equal(kernel(rope, x, cos, sin)(x, cos, sin), apply_rope(x, cos, sin))


def test_mixture_of_experts_layers_keep_their_experts_and_tokens(tmp_path):
    model = load_model(build_moe_checkpoint(tmp_path), dtype="float32")
    expected = greedy(model, [PROMPTS[0]])
    assert use_gpu_decoder_layers(model)
    assert greedy(model, [PROMPTS[0]]) == expected


def test_a_compiler_that_fails_leaves_the_plain_layers(checkpoint, monkeypatch, caplog):
    model = load_model(checkpoint, dtype="float32")
    expected = greedy(model, [PROMPTS[0]])

    def broken(fn, args, constants):
        raise RuntimeError("no working C++ compiler")

    monkeypatch.setattr(matvec, "jit_kernel", broken)
    monkeypatch.setattr(matvec, "_KERNELS", {})
    with caplog.at_level(logging.WARNING, logger="qwen3_scratch.kernels"):
        assert not use_gpu_decoder_layers(model)
    assert "no working C++ compiler" in caplog.text
    assert all(type(layer) is DecoderLayer for layer in model.model.layers)
    assert greedy(model, [PROMPTS[0]]) == expected


def engine_tokens(model, prompts, n=10, block_size=8):
    """Greedy tokens of each prompt through the engine, all added at once (prompt chunks and decodes packed)."""
    engine = LLMEngine(model, None, [], num_blocks=64, block_size=block_size, max_num_batched_tokens=16)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id] += step.new_token_ids
    return list(out.values())


@pytest.fixture
def stored_kernels_on(tmp_path, monkeypatch):
    """Stored kernels turned on, in an empty cache of this test's own: a CPU engine's layers compile their glue
    (as a first start does, until the packages are stored), rather than run it eagerly (the suite's setting)."""
    from qwen3_scratch.kernels import aot

    monkeypatch.setenv("QWEN3_SCRATCH_AOT", "1")
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(aot, "PENDING", {})
    gpu_decode._stored.cache_clear()
    yield
    gpu_decode._stored.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engines_steps_run_the_glue_for_any_token_count_with_the_plain_layers_tokens(checkpoint, dtype,
                                                                                         stored_kernels_on):  # fmt: skip
    """The "batch" layout (a GPU's, and a CPU's until its packages are stored): every engine step (prompt chunks of
    up to 16 tokens and decode rows, packed as one sequence) runs the glue by kernels compiled once for any token
    count."""
    model = load_model(checkpoint, dtype=dtype)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1][:5]]
    expected = engine_tokens(model, prompts)
    assert use_gpu_decoder_layers(model, any_length=True)
    counts = []
    real = gpu_decode.any_size_kernel  # a CPU's any_length_kernel
    gpu_decode.any_size_kernel = lambda fn: (lambda *a, **k: counts.append(a[0].shape[1]) or real(fn)(*a, **k))
    config = model.config  # the pool's in-place kernel, built as the engine's warm-up builds it
    assert paged_attention.supported(config, "cpu", model.activation_dtype)
    try:
        # the kernels built at load serve every step (on a CPU one for any count, one token included): a recompile
        # (seconds, on a GPU a Triton build in the engine's first prompt step) raises
        with torch.compiler.set_stance("fail_on_recompile"):
            assert engine_tokens(model, prompts) == expected, dtype
    finally:
        gpu_decode.any_size_kernel = real
    # steps padded to their buckets: prompt chunks (16 tokens and more) and decode rows (a few) both ran the glue
    assert max(counts) >= 16 and min(counts) <= 4, f"token counts the glue ran for: {sorted(set(counts))}"


@pytest.mark.cuda
@needs_cuda
def test_cuda_decode_layout_runs_the_glue_with_the_plain_layers_tokens(checkpoint):
    model = load_model(checkpoint, device="cuda", dtype=torch.float32, optimize="decode")
    assert all(type(layer) is GPUDecoderLayer for layer in model.model.layers)
    glued = [greedy(model, [p])[0] for p in PROMPTS]
    plain(model)
    assert [greedy(model, [p])[0] for p in PROMPTS] == glued


@pytest.mark.cuda
@needs_cuda
def test_cuda_int8_decode_layout_runs_one_row_kernels_with_the_fused_casts_tokens(checkpoint):
    from qwen3_scratch.kernels.quantize import Int8Linear, use_int8_route

    model = load_model(checkpoint, device="cuda", dtype=torch.float32, quantize="int8", optimize="decode")
    assert {m.route for m in model.modules() if isinstance(m, Int8Linear)} == {"row-kernel"}
    glued = [greedy(model, [p])[0] for p in PROMPTS]
    use_int8_route(model, "fused-cast")
    plain(model)
    assert [greedy(model, [p])[0] for p in PROMPTS] == glued


@pytest.mark.cuda
@needs_cuda
def test_cuda_engine_with_the_glue_gives_the_plain_engines_tokens(checkpoint):
    """The engine's GPU default (flex route, decode steps replayed from graphs) over the "batch" layout, whose
    layers run the glue for any token count: the plain layers' greedy tokens (fp32)."""
    glued = load_model(checkpoint, device="cuda", dtype=torch.float32, optimize="batch")
    assert all(type(layer) is GPUDecoderLayer and layer.any_length for layer in glued.model.layers)
    plain_model = load_model(checkpoint, device="cuda", dtype=torch.float32)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1][:5]]
    assert engine_tokens(glued, prompts, block_size=16) == engine_tokens(plain_model, prompts, block_size=16)
