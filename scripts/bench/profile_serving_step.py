"""Where one batched decode step's time goes: the engine's paged step (in place, and with a gather) against
the contiguous one.

    python scripts/checkpoints/make_shape_checkpoint.py --size 0.6B        # once: weights/qwen3-0.6b-shapes
    python scripts/bench/profile_serving_step.py                     # 16 rows x 512 tokens, bf16 (LLM's CPU default)
    python scripts/bench/profile_serving_step.py --rows 16 --context 512 --steps 10 --dtype float32

It builds the model in serving's layout (q/k/v and gate/up fused, oneDNN-prepacked: what `LLM` loads),
then times --steps decode steps of --rows rows at --context cached tokens, alternating the engine's
runner over the paged pool (attending in place; the cache holds zeros: the time does not depend on the
values), a runner that gathers each row's blocks instead, and the static contiguous cache of the simple
loop, and runs each once more under torch.profiler. Ops are summed into a few kinds: the weight products
(oneDNN), attention (its matmuls and softmax, or the in-place kernel, stored), the layers' glue between the
products where it runs as stored kernels (kernels/gpu_decode.py), kernels torch.compile built (the in-place
attention or the glue of a process that has no stored ones) and apart what calling them costs, the pool's
gather and writes, the other ops (norms, RoPE, SwiGLU where eager, the embedding, masks), and what no op
accounts for (Python, the runner's bookkeeping, dispatch). Sampling is timed on its own: the engine's greedy
sampler over the step's logits.
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qwen3_scratch.checkpoint.placement import pick_dtype  # noqa: E402
from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.engine import paged_attention, sampler  # noqa: E402
from qwen3_scratch.engine.engine import LLMEngine  # noqa: E402
from qwen3_scratch.engine.model_runner import ModelRunner  # noqa: E402
from qwen3_scratch.engine.paged_cache import PagedKVCache  # noqa: E402
from qwen3_scratch.engine.scheduler import Chunk, Sequence  # noqa: E402
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch  # noqa: E402
from qwen3_scratch.kernels.gpu_decode import GPUDecoderLayer  # noqa: E402
from qwen3_scratch.sampling.params import SamplingParams  # noqa: E402

# aten op name -> kind; anything else is "other ops". Compiled kernels show up under their graph's name.
TOP = 0
KINDS = {
    "mkldnn::_linear_pointwise": "weight products", "aten::linear": "weight products", "aten::addmm": "weight products",
    "aten::mm": "weight products", "aten::_weight_int8pack_mm": "weight products",
    "aten::bmm": "attention", "aten::_softmax": "attention", "aten::masked_fill": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::index_select": "pool gather", "aten::index_copy_": "pool write", "aten::index_put_": "pool write",
}  # fmt: skip


# What calling a torch.compile'd function costs besides its kernel: dynamo's guards and the wrapper.
COMPILED_CALL = ("Torch-Compiled Region", "TorchDynamo Cache Lookup", "Pregraph bytecode")


# Regions this script marks (`marked`): a stored kernel (an AOTInductor package) runs no op the profiler sees, so
# its time is its region's own; eager or compiled, the region's ops count on their own and its self time is ~0.
REGIONS = {"## attention in place": "attention", "## glue between products": "glue kernels (stored or compiled)"}


def kind_of(name: str) -> str | None:
    """The kind an event's self time counts under; None for region markers whose ops count on their own."""
    if name in KINDS:
        return KINDS[name]
    if name in REGIONS:
        return REGIONS[name]
    if name.startswith("## Call CompiledFxGraph"):
        return "compiled kernels (torch.compile)"  # inductor's C++ runs as this event's own time
    if name.startswith(COMPILED_CALL):
        return "compiled call (guards, wrapper)"
    if name.startswith("## "):
        return None
    return "other ops"


def decode_chunks(engine: LLMEngine, prompts: list[list[int]], context: int) -> list[Chunk]:
    """One decode chunk per prompt: the newest token after `context` cached ones, blocks allocated."""
    chunks = []
    for i, ids in enumerate(prompts):
        seq = Sequence(str(i), ids, len(ids), SamplingParams(temperature=0), 4, frozenset())
        seq.block_table, _ = engine.blocks.allocate(ids)
        chunks.append(Chunk(seq, context, context + 1))
    return chunks


def marked() -> None:
    """Each in-place attention and each layer's glue call inside a profiler region of its own (see REGIONS)."""
    attend, run = paged_attention.attend_in_place, GPUDecoderLayer.run

    def attend_marked(*args):
        with record_function("## attention in place"):
            return attend(*args)

    def run_marked(self, fn, *args, **constants):
        with record_function("## glue between products"):
            return run(self, fn, *args, **constants)

    paged_attention.attend_in_place, GPUDecoderLayer.run = attend_marked, run_marked


def profiled(fn) -> dict[str, float]:
    """ms per kind for one call of fn, from torch.profiler's self times; 'outside ops' = wall - their sum."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall = (time.perf_counter() - start) * 1e3
    kinds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kind = kind_of(event.key)
        if kind is not None:
            kinds[kind] += event.self_cpu_time_total / 1e3
    if TOP:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP))
    kinds["outside ops (Python, bookkeeping)"] = max(wall - sum(kinds.values()), 0.0)
    kinds["total (profiled)"] = wall
    return dict(kinds)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Profile one batched decode step: paged pool vs contiguous cache.")
    p.add_argument("--checkpoint", default=str(ROOT / "weights" / "qwen3-0.6b-shapes"))
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="timed steps per cache, alternating")
    p.add_argument("--dtype", default="auto")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"cpu: {cpu}, torch threads {torch.get_num_threads()}, load average {__import__('os').getloadavg()}")
    model = load_model(args.checkpoint, dtype=pick_dtype(args.dtype, "cpu"), optimize="batch")
    B, S = args.rows, args.context
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.config.vocab_size, (S + 1,), generator=g).tolist() for _ in range(B)]
    engine = LLMEngine(model, None, [], num_blocks=B * (S // 16 + 2), block_size=16)
    chunks = decode_chunks(engine, prompts, S)
    loop = CachedLoop(model, PaddedBatch.left_pad([ids[:S] for ids in prompts], 0, "cpu"), 2 * args.steps + 8)
    tokens = torch.zeros(B, dtype=torch.long)
    gather = ModelRunner(model, PagedKVCache(model.config, engine.cache.num_blocks, 16, dtype=model.activation_dtype,
                                             in_place=False))  # fmt: skip
    steps = {"paged": lambda: engine.runner.decode(chunks), "gather": lambda: gather.decode(chunks),
             "contiguous": lambda: loop.step(tokens)}  # fmt: skip
    for fn in steps.values():
        fn(), fn()  # warm: oneDNN's kernels for these shapes, any compiled kernel
    times = defaultdict(list)
    for _ in range(args.steps):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    paged, gathered, contiguous = (statistics.median(times[n]) * 1e3 for n in ("paged", "gather", "contiguous"))
    print(f"decode step, {B} rows x {S} tokens (median of {args.steps}): paged in place {paged:.1f} ms, "
          f"paged with a gather {gathered:.1f} ms, contiguous {contiguous:.1f} ms; "
          f"ratios to contiguous {paged / contiguous:.2f} and {gathered / contiguous:.2f}")  # fmt: skip
    logits = steps["paged"]()
    seqs = [c.seq for c in chunks]
    sampled = [profiled(lambda: sampler.sample(seqs, list(logits)))["total (profiled)"] for _ in range(5)]
    marked()
    profiles = {name: profiled(fn) for name, fn in steps.items()}
    kinds = sorted({k for p in profiles.values() for k in p}, key=lambda k: (k.startswith("total"), k))
    print(f"{'ms per step (profiled)':40s} " + " ".join(f"{name:>11s}" for name in profiles))
    for k in kinds:
        print(f"{k:40s} " + " ".join(f"{p.get(k, 0):11.1f}" for p in profiles.values()))
    print(f"{'sampling (greedy, the engine sampler)':40s} {statistics.median(sampled):9.1f}")


if __name__ == "__main__":
    main()
