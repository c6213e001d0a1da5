"""Where one decode step's time goes, op by op, at the exact Qwen3-0.6B shapes (random weights).

    python scripts/checkpoints/make_shape_checkpoint.py --size 0.6B        # once: weights/qwen3-0.6b-shapes
    python scripts/bench/profile_decode.py                           # bf16 and fp32, plain and optimized layouts
    python scripts/bench/profile_decode.py --dtypes bfloat16 --layouts optimized,int8 --steps 20

For each layout (plain: load_model as transformers' layout, one F.linear per checkpoint matrix;
packed: q/k/v and gate/up fused and prepacked for oneDNN, as serving (LLM) loads; optimized: the
checkpoint's matrices multiplied by compiled one-row loops (matvec.py), as the Pipeline loads; int8: +
int8 weights) it prefills a prompt, then times --steps decode steps with a clock around every op:
each projection, the norms, RoPE, the KV-cache write, attention (SDPA), lm_head and the sampler.
Per op: ms per step (median over the steps), bytes it reads per step (its weights; attention: the
keys and values of the context), achieved GB/s, and its share of the step. The bandwidth is measured
in the same run, before and after, so "GB/s" can be read against it. The clocks add a few
microseconds per op; the untimed step (no clocks) is printed beside their sum.
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from make_shape_checkpoint import default_out, make_shape_checkpoint  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch  # noqa: E402
from qwen3_scratch.kernels.cpu_decode import CPUDecoderLayer  # noqa: E402
from qwen3_scratch.model import qwen3 as model_module  # noqa: E402
from qwen3_scratch.model.kv_cache import KVCache  # noqa: E402
from qwen3_scratch.model.qwen3 import RMSNorm  # noqa: E402
from qwen3_scratch.sampling.logits import LogitsFilter, sample  # noqa: E402

LAYOUTS = {"plain": {}, "packed": dict(optimize="batch"), "optimized": dict(optimize="decode"),
           "int8": dict(optimize="decode", quantize="int8")}
PROJECTIONS = {"q_proj": "q/k/v", "k_proj": "q/k/v", "v_proj": "q/k/v", "qkv_proj": "q/k/v", "o_proj": "o",
               "gate_proj": "gate/up", "up_proj": "gate/up", "gate_up_proj": "gate/up", "down_proj": "down",
               "lm_head": "lm_head"}  # fmt: skip


class OpClock:
    """Wall time per op category, summed over one step; `record` is on only while a step is timed."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.bytes: dict[str, int] = defaultdict(int)
        self.record = False

    def timed(self, op: str, fn, nbytes=None):
        def wrapper(*args, **kwargs):
            if not self.record:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.step[op] += time.perf_counter() - start
            if nbytes is not None:
                self.bytes[op] += nbytes(*args)
            return out

        return wrapper

    def end_step(self):
        self.steps.append(dict(self.step))
        self.step.clear()


def module_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def attach(model, clock: OpClock) -> None:
    """Wrap each op in a clock: modules through their forward, functions through the model's globals."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in PROJECTIONS:
            op, nbytes = PROJECTIONS[leaf], module_bytes(module)
            module.forward = clock.timed(op, module.forward, lambda *a, n=nbytes: n)
        elif isinstance(module, RMSNorm):
            n = module_bytes(module)
            module.forward = clock.timed("norms", module.forward, lambda *a, n=n: n)
    model_module.apply_rope = clock.timed("rope", model_module.apply_rope)
    # SDPA reads the context's keys and values: (B, K, S, D) each
    sdpa = clock.timed("attention (SDPA)", F.scaled_dot_product_attention, lambda q, k, v, **kw: k.nbytes + v.nbytes)
    model_module.F = type("F", (), {"scaled_dot_product_attention": staticmethod(sdpa), "silu": F.silu})
    model_module.one_query_attention = clock.timed(  # CPU decode in bf16 attends this way instead
        "attention (SDPA)", model_module.one_query_attention, lambda q, k, v, mask=None: k.nbytes + v.nbytes
    )
    KVCache.update = clock.timed("kv-cache write", KVCache.update)
    # the decode layout's compiled kernels between the products (cpu_decode.py): norms, RoPE, residual, SwiGLU
    CPUDecoderLayer.kernel = clock.timed("norms, RoPE, residuals, SwiGLU (compiled)", CPUDecoderLayer.kernel)


def profile_layout(path: Path, dtype: str, layout: str, steps: int, prompt_len: int) -> dict:
    clock = OpClock()
    model = load_model(path, "cpu", dtype, **LAYOUTS[layout])
    greedy = LogitsFilter(temperature=0.0)
    sampler = clock.timed("sampling (argmax)", sample)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    loop = CachedLoop(model, PaddedBatch.left_pad([prompt.tolist()], 0, "cpu"), 2 * steps + 4)
    token = sampler(loop.start(), greedy)
    untimed = []
    for _ in range(steps):  # untimed steps first: the real step time, without the clocks
        start = time.perf_counter()
        token = sample(loop.step(token), greedy)
        untimed.append(time.perf_counter() - start)
    attach(model, clock)
    for _ in range(steps):
        clock.record = True
        token = sampler(loop.step(token), greedy)
        clock.record = False
        clock.end_step()
    restore()
    return {"clock": clock, "untimed_s": statistics.median(untimed), "steps": steps}


ORIGINALS = (model_module.apply_rope, model_module.F, KVCache.update, model_module.one_query_attention,
             CPUDecoderLayer.kernel)


def restore() -> None:
    """Undo attach's wraps of module-level functions (wrapped modules die with their model)."""
    (model_module.apply_rope, model_module.F, KVCache.update, model_module.one_query_attention,
     CPUDecoderLayer.kernel) = ORIGINALS


def print_table(result: dict, dtype: str, layout: str, bandwidth: float) -> None:
    clock, n = result["clock"], result["steps"]
    ops = sorted({op for s in clock.steps for op in s}, key=lambda op: -statistics.median(s.get(op, 0) for s in clock.steps))
    total = sum(statistics.median(s.get(op, 0) for s in clock.steps) for op in ops)
    print(f"\n{dtype}, {layout}: untimed step {result['untimed_s'] * 1e3:.1f} ms, sum of op clocks {total * 1e3:.1f} ms "
          f"(median of {n} steps); bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    print("| op | ms/step | MB read/step | GB/s | % of bandwidth | share of step |")
    print("|---|---:|---:|---:|---:|---:|")
    for op in ops:
        t = statistics.median(s.get(op, 0) for s in clock.steps)
        nbytes = clock.bytes.get(op, 0) / n
        rate = nbytes / t / 1e9 if t and nbytes else 0
        print(f"| {op} | {t * 1e3:.2f} | {nbytes / 1e6:.1f} | {rate:.1f} | {rate * 1e9 / bandwidth:.0%} | {t / total:.0%} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(default_out("0.6B")))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--layouts", default="plain,optimized,int8", help=f"any of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    path = Path(args.checkpoint)
    if not (path / "config.json").exists():
        print(f"writing the 0.6B-shaped checkpoint to {path}", flush=True)
        make_shape_checkpoint("0.6B", path)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("command: python scripts/bench/profile_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    for dtype in args.dtypes.split(","):
        for layout in args.layouts.split(","):
            if layout == "int8" and dtype != "bfloat16":
                continue  # int8 runs with bf16 activations
            before = fresh_bandwidth()
            result = profile_layout(path, dtype, layout, args.steps, args.prompt_tokens)
            after = fresh_bandwidth()
            print(f"\nbandwidth before {before / 1e9:.1f} GB/s, after {after / 1e9:.1f} GB/s; the table uses the larger")
            print_table(result, dtype, layout, max(before, after))


def fresh_bandwidth() -> float:
    """measure_bandwidth caches its answer per process; a profile wants it now, beside each table."""
    from qwen3_scratch.generation import stats

    stats._BANDWIDTH_CACHE.clear()
    return stats.measure_bandwidth("cpu")


if __name__ == "__main__":
    main()
