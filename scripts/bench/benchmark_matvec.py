"""One activation row times each Qwen3-0.6B matrix: how fast each CPU kernel reads the weights.

    python scripts/bench/benchmark_matvec.py                 # fp32, bf16, int8 and int4; GB/s per kernel and matrix
    python scripts/bench/benchmark_matvec.py --rows 5 --dtypes bfloat16   # 5 rows: speculation's few-row products
    python scripts/bench/benchmark_matvec.py --rows 16 --dtypes float32,bfloat16   # a short prompt's products

Batch-1 decode is these products and little else, so a kernel's GB/s here is the ceiling of decode
speed. Per matrix shape, 28 layers' worth of matrices (the lm_head once) so nothing stays in the
caches; per kernel the median of 7 passes; the copy bandwidth (stats.measure_bandwidth) is measured in
the same run. Kernels: torch's F.linear; oneDNN's prepacked product (fuse.PackedLinear, serving's
layout); for int8 torch._weight_int8pack_mm, torch._int_mm with the activation row quantized to int8
(int32 sums: VNNI's route, as llama.cpp's Q8_0 x Q8_0) and ours, the compiled one-row loop (matvec.py);
for int4 (group 32, bf16 activations) torch._weight_int4pack_mm_for_cpu, what kernels/int4.py runs, and
the compiled loop it was measured against (`int4_loop` below: unpack two nibbles, widen, multiply-add).
int4 bytes count the nibbles and the bf16 scale and zero point of each group.
With --rows R (2 or more, fp32 or bf16): R activation rows, as a verification forward of speculative decoding
(2 to 16) or a prompt has. fp32 through F.linear (MKL's sgemm) and through oneDNN's matmul on the same matrix
(kernels/sgemm.py); bf16 through F.linear, through the matrices packed once for oneDNN (kernels/fewrow.py; up to 16
rows, not on a CPU whose oneDNN has no bf16 kernel) and widened to fp32 a block at a time (kernels/widen.py), its
fp32 products by MKL and by oneDNN. GB/s is still the weight bytes over the time, so R rows that share one read of
the weights run at one row's speed; GFLOP/s counts 2 R N K.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: qwen3_scratch

from machine import Table, machine, machine_line  # noqa: E402

from qwen3_scratch.generation.stats import measure_bandwidth  # noqa: E402
from qwen3_scratch.kernels import fewrow, sgemm, widen  # noqa: E402
from qwen3_scratch.kernels.int4 import quantize_and_pack, quantize_groups  # noqa: E402
from qwen3_scratch.kernels.matvec import kernel, matvec, matvec_int8, slice_rows  # noqa: E402
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
    ours = kernel(matvec, x.float(), weights[0])
    sliced = kernel(matvec, x.float(), weights[0], rows=slice_rows(len(weights[0])))
    kernels = {"F.linear": lambda: [F.linear(x, w) for w in weights]}
    if x.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():  # oneDNN packs no bf16 on AVX2 alone
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        kernels["oneDNN packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
    kernels["ours (compiled), one slice"] = lambda: [ours(x.float(), w) for w in weights]
    # what a decode runs: the matrix's rows in slices summed at once (matvec.slice_rows; for one matrix alone)
    kernels["ours (compiled), in slices"] = lambda: [sliced(x.float(), w) for w in weights]
    return kernels


def chosen(choice: str, products):
    """products, with several-row fp32 products run by sgemm's `choice` ("mkl" or "onednn")."""
    def run():
        with sgemm.choose(choice):
            return products()
    return run


def few_row_kernels(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    kernels = {"F.linear": lambda: [F.linear(x, w) for w in weights]}
    if x.dtype == torch.float32:
        kernels["oneDNN, same matrix (sgemm.py)"] = chosen("onednn", lambda: [sgemm.linear(x, w) for w in weights])
        return kernels
    if fewrow.unavailable_reason() is None and len(x) <= fewrow.MAX_ROWS:
        packed = [fewrow.pack(w) for w in weights]
        kernels["oneDNN packed (fewrow.py)"] = lambda: [fewrow.fewrow(x, p) for p in packed]
    for choice in sgemm.CHOICES:
        kernels[f"widened to fp32 (widen.py), {choice}"] = chosen(choice, lambda: [widen.linear(x, w) for w in weights])
    return kernels


def int8_kernels(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    quantized = [quantize_rows(w) for w in weights]
    quantized = [(q, s.to(x.dtype)) for q, s in quantized]
    ours = kernel(matvec_int8, x.float(), *quantized[0])
    return {
        "_weight_int8pack_mm": lambda: [torch._weight_int8pack_mm(x, q, s) for q, s in quantized],
        "ours (compiled)": lambda: [ours(x.float(), q, s) for q, s in quantized],
    }


def int8_activation_kernels(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    """int8 x int8 -> int32 products; the row's own quantization (one scale) is a few µs and not timed."""
    quantized = [quantize_rows(w)[0].t() for w in weights]  # (K, N) views of the (N, K) int8 rows
    x8 = torch.round(x.float() / (x.float().abs().max() / 127)).to(torch.int8)  # (1, K)
    return {"_int_mm (int8 activations)": lambda: [torch._int_mm(x8, q) for q in quantized]}


def int4_loop(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The loop kernels/int4.py did not keep: x (K/32, 2, 16) fp32, nibbles (N, K/32, 16) uint8 (low: weight j
    of a group, high: weight j + 16), scale and zero (N, K/32) -> (N,) bf16."""
    low = (nibbles & 15).float() * scale[..., None] + zero[..., None]  # (N, K/32, 16)
    high = (nibbles >> 4).float() * scale[..., None] + zero[..., None]
    return ((low * x[:, 0]).sum((-1, -2)) + (high * x[:, 1]).sum((-1, -2))).to(torch.bfloat16)


def int4_kernels(weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    packed = [quantize_and_pack(w, 32) for w in weights]
    packed = [(p, sz.to(torch.bfloat16)) for p, sz in packed]
    loops = []
    for w in weights:  # the same codes in the loop's own layout; zero here is the group's minimum
        codes, sz = quantize_groups(w, 32)
        n, k = codes.shape
        c = codes.view(n, k // 32, 2, 16).to(torch.uint8)
        lo = (sz[..., 1] - 8 * sz[..., 0]).t().contiguous()  # (N, K/32)
        loops.append(((c[:, :, 0] | c[:, :, 1] << 4).contiguous(), sz[..., 0].t().contiguous(), lo))
    xs = x.float().view(-1, 2, 16)  # (K/32, 2, 16)
    loop = kernel(int4_loop, xs, *loops[0])
    return {
        "_weight_int4pack_mm_for_cpu": lambda: [torch._weight_int4pack_mm_for_cpu(x, p, 32, sz) for p, sz in packed],
        "compiled loop (not kept)": lambda: [loop(xs, *args) for args in loops],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int4")
    p.add_argument("--rows", type=int, default=1, help="activation rows per product (2 or more: fp32 and bf16 only)")
    args = p.parse_args(argv)
    if args.rows < 1:
        p.error(f"--rows {args.rows}: give 1 or more rows")
    if args.rows > 1 and not set(args.dtypes.split(",")) <= {"float32", "bfloat16"}:
        p.error(f"--rows {args.rows}: several-row products are measured for fp32 and bf16 only; "
                "add --dtypes float32,bfloat16")
    torch.set_grad_enabled(False)
    print(machine_line(machine("cpu", measure_bandwidth("cpu"))))  # bandwidth_gb_s: the copy bandwidth
    print(f"command: python scripts/bench/benchmark_matvec.py {' '.join(argv or sys.argv[1:])}\n")
    table = Table("matrix", "dtype", "kernel", "GB/s", "GFLOP/s", text_columns=3)
    for name, (n, k, count) in SHAPES.items():
        for dtype in args.dtypes.split(","):
            float_dtype = torch.bfloat16 if dtype in ("int8", "int4") else getattr(torch, dtype)
            weights = [torch.randn(n, k).to(float_dtype) for _ in range(count)]
            x = torch.randn(args.rows, k).to(float_dtype)
            if args.rows > 1:
                kernels = few_row_kernels(weights, x)
            elif dtype == "int8":
                kernels = {**int8_kernels(weights, x), **int8_activation_kernels(weights, x)}
            else:
                kernels = int4_kernels(weights, x) if dtype == "int4" else float_kernels(weights, x)
            element = {"int8": 1, "int4": 0.5 + 4 / 32}.get(dtype, weights[0].element_size())
            if dtype in ("int8", "int4"):
                del weights  # only the quantized copies are read
            for label, products in kernels.items():
                rate = gb_per_s(products, round(n * k * count * element))  # weight GB/s
                flops = rate / element * 2 * args.rows  # 2 R N K over the time
                table.row(name, dtype, label, f"{rate:.1f}", f"{flops:.1f}")


if __name__ == "__main__":
    main()
