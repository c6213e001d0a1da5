"""One activation row times each Qwen3-0.6B matrix: how fast each CPU kernel reads the weights.

    python scripts/benchmark_matvec.py                 # fp32, bf16 and int8; GB/s per kernel and matrix

Batch-1 decode is these products and little else, so a kernel's GB/s here is the ceiling of decode
speed. Per matrix shape, 28 layers' worth of matrices (the lm_head once) so nothing stays in the
caches; per kernel the median of 7 passes; the copy bandwidth (stats.measure_bandwidth) is measured in
the same run. Kernels: torch's F.linear; oneDNN's prepacked product (fuse.PackedLinear, serving's
layout); for int8 torch._weight_int8pack_mm; and ours, the compiled one-row loop (matvec.py).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwen3_scratch.generation.stats import measure_bandwidth  # noqa: E402
from qwen3_scratch.kernels.matvec import kernel, matvec, matvec_int8  # noqa: E402
from qwen3_scratch.kernels.quantize import quantize_rows  # noqa: E402

SHAPES = {"q/k/v (4096x1024)": (4096, 1024, 28), "o (1024x2048)": (1024, 2048, 28),
          "gate/up (6144x1024)": (6144, 1024, 28), "down (1024x3072)": (1024, 3072, 28),
          "lm_head (151936x1024)": (151936, 1024, 1)}  # fmt: skip


def gb_per_s(products, nbytes: int, passes: int = 7) -> float:
    products()  # warm-up
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        products()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def float_kernels(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    ours = kernel(matvec, x.float(), weights[0])
    return {
        "F.linear": lambda: [F.linear(x, w) for w in weights],
        "oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
        "ours (compiled)": lambda: [ours(x.float(), w) for w in weights],
    }


def int8_kernels(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    quantized = [quantize_rows(w) for w in weights]
    quantized = [(q, s.to(x.dtype)) for q, s in quantized]
    ours = kernel(matvec_int8, x.float(), *quantized[0])
    return {
        "_weight_int8pack_mm": lambda: [torch._weight_int8pack_mm(x, q, s) for q, s in quantized],
        "ours (compiled)": lambda: [ours(x.float(), q, s) for q, s in quantized],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16,int8")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"command: python scripts/benchmark_matvec.py {' '.join(argv or sys.argv[1:])}")
    print(f"copy bandwidth {measure_bandwidth('cpu') / 1e9:.1f} GB/s\n")
    print("| matrix | dtype | kernel | GB/s |\n|---|---|---|---:|")
    for name, (n, k, count) in SHAPES.items():
        for dtype in args.dtypes.split(","):
            float_dtype = torch.bfloat16 if dtype == "int8" else getattr(torch, dtype)
            weights = [torch.randn(n, k).to(float_dtype) for _ in range(count)]
            x = torch.randn(1, k).to(float_dtype)
            kernels = int8_kernels(weights, x) if dtype == "int8" else float_kernels(weights, x)
            element = 1 if dtype == "int8" else weights[0].element_size()
            if dtype == "int8":
                del weights  # only the int8 copies are read
            for label, products in kernels.items():
                print(f"| {name} | {dtype} | {label} | {gb_per_s(products, n * k * count * element):.1f} |", flush=True)


if __name__ == "__main__":
    main()
