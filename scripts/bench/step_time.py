"""One batch-1 greedy decode step's time at the 0.6B shapes (bf16, decode layout), and the part of it
that is not a weight read, two ways:

- rest_ms: the step minus its products run alone (every matrix's own compiled one-row loop, the same
  inputs, back to back): attention, the kernels between the products, Python and sampling. Since a
  layer runs as two whole-half kernels (kernels/cpu_decode.py), whose products stream faster than the
  separate loops, this goes below zero;
- over_limit_ms: the step minus the time to read its weights once at the copy bandwidth measured in
  the same process (generation.stats.measure_bandwidth, its threads): what the step spends beyond the
  memory's limit, whatever it is.

    python scripts/bench/step_time.py --threads 1                  # this checkout
    PYTHONPATH=/other/checkout python scripts/bench/step_time.py   # another (alternate the two, compare medians)

Prints one JSON line: median ms per step, median ms of the products alone, their difference.

--python-only times the step with every stored kernel answering from memory (its outputs of the first step
that called it with those shapes: no arithmetic), so what is left is the Python and the small ops between the
kernels, free of the host's bandwidth swings (a change of 0.7 ms a step shows in every round, where whole steps
of the same code vary by 3 ms). It needs the kernels stored (a CLI run first; not with QWEN3_SCRATCH_AOT=0):
`stubbed_calls` says how many a step answered from memory.
"""

import argparse
import json
import statistics
import time

import torch

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.loops import CachedLoop, PaddedBatch
from qwen3_scratch.generation.stats import measure_bandwidth
from qwen3_scratch.kernels.aot import PackagedKernel
from qwen3_scratch.kernels.cpu_decode import CPUDecoderLayer
from qwen3_scratch.kernels.int4 import Int4Linear
from qwen3_scratch.kernels.matvec import MatvecLinear
from qwen3_scratch.kernels.quantize import Int8Linear
from qwen3_scratch.sampling.logits import LogitsFilter, sample


def step_products(model) -> list:
    """The one-row products of a step: the decode layout's MatvecLinears, int8's Int8Linears or int4's Int4Linears."""
    return [m for m in model.modules() if isinstance(m, (MatvecLinear, Int8Linear, Int4Linear))]


def product_tensors(m) -> list[torch.Tensor]:
    """What one product reads from memory: its weight, and its scales (int8) or scales and zeros (int4), as the
    decode layer hands them to its kernels."""
    return CPUDecoderLayer.weights(m)


def products_alone(model) -> float:
    """Seconds for every one-row product of a step (each matrix's own compiled loop) alone."""
    linears = step_products(model)
    rows = [torch.randn(1, m.in_features, dtype=torch.bfloat16 if isinstance(m, Int4Linear) else None) for m in linears]
    start = time.perf_counter()
    for m, x in zip(linears, rows):
        if isinstance(m, Int4Linear):  # torch's int4 kernel, bf16 rows
            m(x)
        elif isinstance(m, MatvecLinear):
            m.kernel(x, m.weight)
        else:  # int8: its codes as the loop reads them (the words on a CPU with AVX2 only)
            m.kernel(x, m.codes, m.scales)
    return time.perf_counter() - start


def python_only(model, steps: int, rounds: int) -> dict:
    """Median ms of a step whose stored kernels answer from memory (--python-only), over `rounds` runs of
    `steps` steps, and how many kernel calls a step that was."""
    real, answers, calls = PackagedKernel.__call__, {}, [0]

    def from_memory(kernel, *args):
        calls[0] += 1
        key = (id(kernel), *(a.shape for a in args))
        if key not in answers:
            answers[key] = real(kernel, *args)
        return answers[key]

    greedy, times = LogitsFilter(temperature=0.0), []
    with torch.no_grad():
        for _ in range(rounds):
            loop = CachedLoop(model, PaddedBatch.left_pad([list(range(100, 116))], 0, "cpu"), steps + 4)
            token = sample(loop.start(), greedy)
            for _ in range(2):  # each kernel's first call computes, with the shapes every later step has
                token = sample(loop.step(token), greedy)
            PackagedKernel.__call__, calls[0] = from_memory, 0
            start = time.perf_counter()
            for _ in range(steps):
                token = sample(loop.step(token), greedy)
            times.append((time.perf_counter() - start) / steps)
            PackagedKernel.__call__ = real
    return dict(python_ms=round(statistics.median(times) * 1e3, 3), stubbed_calls=calls[0] // steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="weights/qwen3-0.6b-shapes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--quantize", choices=["int8", "int4"], default=None,
                        help="int8 or int4 (group 32) weights, bf16 activations")
    parser.add_argument("--python-only", type=int, metavar="ROUNDS", default=0,
                        help="time ROUNDS runs of steps whose stored kernels answer from memory (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.checkpoint, "cpu", torch.bfloat16, optimize="decode", quantize=args.quantize)
    if args.python_only:
        result = python_only(model, args.steps, args.python_only)
        print(json.dumps(dict(threads=args.threads, quantize=args.quantize, **result)))
        return
    loop = CachedLoop(model, PaddedBatch.left_pad([list(range(100, 116))], 0, "cpu"), args.steps + 8)
    greedy, steps, products = LogitsFilter(temperature=0.0), [], []
    with torch.no_grad():
        token = sample(loop.start(), greedy)
        for i in range(args.steps + 8):
            start = time.perf_counter()
            token = sample(loop.step(token), greedy)
            steps.append(time.perf_counter() - start)
            products.append(products_alone(model))
    step, product = (statistics.median(t[8:]) * 1e3 for t in (steps, products))  # the first 8 warm up
    weight_bytes = sum(t.nbytes for m in step_products(model) for t in product_tensors(m))
    limit = weight_bytes / measure_bandwidth("cpu") * 1e3
    print(json.dumps(dict(threads=args.threads, quantize=args.quantize, step_ms=round(step, 2), products_ms=round(product, 2),
                          rest_ms=round(step - product, 2), limit_ms=round(limit, 2), over_limit_ms=round(step - limit, 2))))


if __name__ == "__main__":
    main()
