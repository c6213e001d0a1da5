"""A candidate layout for int4 decode on a CPU with AVX2 only, measured against torch's int4 kernel.

torch's `_weight_int4pack_mm_for_cpu` is bound by compute on an AVX2 CPU (about 13 G weights/s on two Zen 3
cores, where the memory would stream about 50 G nibbles/s). The candidate is written as plain torch ops and compiled by
inductor (matvec.kernel), as the int8 words loop is:

- the codes eight nibbles to a 32-bit word, read as float32 (the load at::vec does at full speed on AVX2):
  nibble b of word j holds column b*K/8 + j;
- the words of eight rows side by side, so a vector holds eight rows and the row's activation is one broadcast
  number: no horizontal sum, and a group's scale multiplies eight rows' partial sums at once;
- each group's sum of q * x in fp32, times its scale, plus (zero - 8 * scale) times the group's sum of x: the
  product of the dequantized matrix in fp32, with no bf16 rounding of the weights (torch's kernel rounds them).

    python scripts/bench/int4_rows_ab.py                 # the 0.6B shapes, 32 matrices of each cycled (out of cache)

Prints G weights/s per shape for both, two rounds each, and the relative error against the fp64 product of the
dequantized matrix. Not used by the package: the figures are in docs/performance.md.
"""

import argparse
import time

import torch

from qwen3_scratch.kernels import int4
from qwen3_scratch.kernels.matvec import kernel

GROUP = 32
ROWS = 8  # rows side by side: one AVX2 vector of fp32
SHAPES = {"q/k/v": (4096, 1024), "o": (1024, 2048), "gate/up": (6144, 1024), "down": (1024, 3072)}


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) in [0, 15] -> words (N/8, K/8, 8) float32: [m, j, r] holds row 8m + r's column b*K/8 + j
    in nibble b."""
    N, K = codes.shape
    c = codes.view(N // ROWS, ROWS, 8, K // 8).permute(0, 3, 1, 2).to(torch.int32)  # (m, j, r, b)
    words = torch.zeros(N // ROWS, K // 8, ROWS, dtype=torch.int32)
    for b in range(8):
        words |= c[..., b] << (4 * b)
    return words.view(torch.float32)


def by_rows(t: torch.Tensor) -> torch.Tensor:
    """A per-group (N, G) tensor as the words lay rows out: (N/8, G, 8)."""
    N, G = t.shape
    return t.view(N // ROWS, ROWS, G).transpose(1, 2).contiguous()


def int4_rows(eighths, group_sums, words, scales, offsets):
    """eighths (8, K/8): x in eighths; group_sums (G,): x summed by group; words (N/8, K/8, 8); scales and
    offsets (N/8, G, 8), offset = zero - 8 * scale -> (N,) fp32."""
    M, W, _ = words.shape
    J = W // GROUP  # groups in an eighth
    bits = words.view(torch.int32).view(M, J, GROUP, ROWS)
    s = scales.view(M, 8, J, ROWS)
    y = (offsets * group_sums.view(1, -1, 1)).sum(1)  # (M, 8)
    for b in range(8):
        q = ((bits >> (4 * b)) & 15).float()
        y = y + ((q * eighths[b].view(J, GROUP, 1)).sum(2) * s[:, b]).sum(1)
    return y.view(-1)


def seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(N: int, K: int, copies: int, rounds: int) -> str:
    """One shape: both products on `copies` random matrices, cycled; G weights/s a round, and their errors."""
    codes, scales_and_zeros = zip(*(int4.quantize_groups(torch.randn(N, K) * 0.02, GROUP) for _ in range(copies)))
    x = torch.randn(1, K)
    words = [pack_rows(q) for q in codes]
    scales = [by_rows(sz[..., 0].t().contiguous()) for sz in scales_and_zeros]
    offsets = [by_rows((sz[..., 1] - 8 * sz[..., 0]).t().contiguous()) for sz in scales_and_zeros]
    eighths, group_sums = x.view(8, K // 8).contiguous(), x.view(K // GROUP, GROUP).sum(-1)
    compiled = kernel(int4_rows, eighths, group_sums, words[0], scales[0], offsets[0])
    packed = [int4.pack(q) for q in codes]
    torch_sz = [sz.bfloat16() for sz in scales_and_zeros]
    xb = x.bfloat16()

    def theirs(i: int) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(xb, packed[i], GROUP, torch_sz[i])

    def ours(i: int) -> torch.Tensor:
        return compiled(eighths, group_sums, words[i], scales[i], offsets[i])

    exact = (x.double() @ int4.dequantize(codes[0], scales_and_zeros[0]).double().t())[0]

    def error(y: torch.Tensor) -> float:
        return ((y.double().view(-1) - exact).abs().max() / exact.abs().max()).item()

    line = []
    for _ in range(rounds):
        t_torch = seconds(lambda: [theirs(i) for i in range(copies)]) / copies
        t_rows = seconds(lambda: [ours(i) for i in range(copies)]) / copies
        line.append(f"torch {N * K / t_torch / 1e9:5.1f}, rows {N * K / t_rows / 1e9:5.1f}")
    return " | ".join(line) + f"  (error: torch {error(theirs(0)):.1e}, rows {error(ours(0)):.1e})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=32, help="matrices of each shape, cycled (default 32)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.copies} matrices a shape; G weights/s")
    for name, (N, K) in SHAPES.items():
        print(f"{name:8s} {N}x{K}: {measure(N, K, args.copies, args.rounds)}", flush=True)


if __name__ == "__main__":
    main()
