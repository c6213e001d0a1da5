"""int4's two CPU loops side by side on the same codes: the words layout (kernels/int4.py: fp32 rows, exact) and the
pairs layout (kernels/int4_pairs.py: rows rounded to int8 codes, two matrix rows to a 32-bit lane).

Builds both layouts from the same random codes and bf16 scales for the 0.6B shapes (28 layers' four products,
q/k/v and gate/up fused, each matrix its own so that nothing stays in cache, and the lm_head), checks the pairs'
bf16 products against float64's on the rounded rows (to bf16's rounding), says how far rounding the rows moves a
product, and times both loops alternating (medians), for one activation row (a decode step) or --rows of them (a
batch's step: each layout's blocks of rows, as Int4Linear runs them):

    PYTHONPATH=. python scripts/bench/int4_layouts_ab.py [--threads 2] [--repeats 15] [--rows 8]

docs/performance.md has the figures ("int4 in pairs").
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from qwen3_scratch.kernels import int4, int4_pairs, matvec

LAYER = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))  # fused q/k/v, o, fused gate/up, down
LM_HEAD = (151936, 1024)
GROUP = int4_pairs.GROUP


def layouts(N: int, K: int, generator: torch.Generator):
    """The same codes and (scale, zero) pairs as the words and as the pairs read them, and the dequantized matrix."""
    codes = torch.randint(0, 16, (N, K), generator=generator, dtype=torch.int32)
    scale = torch.rand(N, K // GROUP, generator=generator) * 0.02
    zero = torch.randn(N, K // GROUP, generator=generator) * 1e-3
    sz = torch.stack([scale.t(), zero.t()], dim=-1).bfloat16()  # (G, N, 2), as Int4Linear keeps them in bf16
    words = (int4.pack_words(codes).view(torch.float32), int4.words_scales(sz).view(torch.float32))
    pairs = (int4_pairs.pack_pairs(codes).view(torch.float32), int4_pairs.pairs_scales(sz).view(torch.float32))
    return words, pairs, int4.dequantize(codes, sz.float())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rows", type=int, default=1, help="activation rows a product (a batch's decode step: 8, 16)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"{cpu}, {args.threads} threads, torch {torch.__version__}, {capability}, {args.rows} rows a product")
    g = torch.Generator().manual_seed(0)
    layouts_ = (("words", int4.words_product), ("pairs", int4_pairs.pairs_product))
    for label, shapes, copies in (("28 layers' products", LAYER, 28), ("lm_head", (LM_HEAD,), 1)):
        calls = {"words": [], "pairs": []}
        worst, moved, weights = 0.0, 0.0, 0
        for N, K in shapes:
            x = torch.randn(args.rows, K, generator=g)
            for i in range(copies):
                words, pairs, matrix = layouts(N, K, g)
                for (name, loop), tensors in zip(layouts_, (words, pairs), strict=True):
                    # the rows as Int4Linear.words_product runs them: blocks of each size, largest first
                    for start, size in int4.row_blocks(args.rows):
                        rows = x[start : start + size]
                        calls[name].append((matvec.kernel(loop, rows, *tensors), (rows, *tensors)))
                weights += N * K
                if i == 0:  # the pairs against float64 on the rounded rows, and what rounding the rows moves
                    got = torch.cat([fn(*a) for fn, a in calls["pairs"][-len(int4.row_blocks(args.rows)) :]])
                    want = int4_pairs.rounded_rows(x).double() @ matrix.double().t()
                    worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
                    exact = x.double() @ matrix.double().t()
                    moved = max(moved, ((want - exact).norm() / exact.norm()).item())
        times = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, kernels in calls.items():
                start = time.perf_counter()
                for fn, a in kernels:
                    fn(*a)
                times[name].append(time.perf_counter() - start)
        t = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{label}: words {t['words'] * 1e3:.2f} ms ({weights / t['words'] / 1e9:.1f} G weights/s), pairs "
              f"{t['pairs'] * 1e3:.2f} ms ({weights / t['pairs'] / 1e9:.1f}), x{t['words'] / t['pairs']:.2f}; the "
              f"pairs' "
              f"bf16 products against float64's on the rounded rows: {worst:.1e} (max, relative, < 2**-8); rounding "
              f"the rows moved the product {moved:.1e} (rms, relative)")  # fmt: skip


if __name__ == "__main__":
    main()
