"""A candidate layout for int4 decode on a CPU with AVX2 only, measured against torch's int4 kernel.

torch's `_weight_int4pack_mm_for_cpu` is bound by compute on an AVX2 CPU (about 13 G weights/s on two Zen 3
cores, where the memory would stream about 50 G nibbles/s). The candidate is written as plain torch ops and compiled by
inductor (matvec.kernel), as the int8 words loop is:

- the codes eight nibbles to a 32-bit word, read as float32 (the load at::vec does at full speed on AVX2):
  nibble b of word j holds column 8j + b, so a word lies inside one group;
- the words of eight rows side by side, so a vector holds eight rows and the row's activation is one broadcast
  number: no horizontal sum, and a group's scale multiplies eight rows' partial sums at once;
- each nibble position its own accumulator; each group's sum of q * x in fp32 times its scale, plus
  (zero - 8 * scale) times the group's sum of x: the product of the dequantized matrix in fp32, with no bf16
  rounding of the weights (torch's kernel rounds them).

Several rows (`--rows`) run the loop once per row, against torch's kernel, which unpacks each weight once for
all the rows. So a second candidate (the third column) reads torch's own packing, which torch's kernel keeps
serving for several rows: its bytes as float32 words, eight words being two columns of sixteen rows; the eight
(byte, nibble) extractions of a word each give eight rows; the scales laid out by lane (twice each: two columns
share a row), and by row for the zero points' term.

    python scripts/bench/int4_rows_ab.py                 # the 0.6B shapes, 32 matrices of each cycled (out of cache)
    python scripts/bench/int4_rows_ab.py --rows 8,21,64  # several rows: ms for one 6144 x 1024 matrix

Prints G weights/s per shape for the three, two rounds each, and the relative error against the fp64 product of the
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
    """codes (N, K) in [0, 15] -> words (N/8, K/8, 8) float32: [m, j, r] holds row 8m + r's columns 8j .. 8j + 7,
    column 8j + b in nibble b."""
    N, K = codes.shape
    c = codes.view(N // ROWS, ROWS, K // 8, 8).permute(0, 2, 1, 3).to(torch.int32)  # (m, j, r, b)
    words = torch.zeros(N // ROWS, K // 8, ROWS, dtype=torch.int32)
    for b in range(8):
        words |= c[..., b] << (4 * b)
    return words.view(torch.float32)


def by_rows(t: torch.Tensor) -> torch.Tensor:
    """A per-group (N, G) tensor as the words lay rows out: (N/8, G, 8)."""
    N, G = t.shape
    return t.view(N // ROWS, ROWS, G).transpose(1, 2).contiguous()


def int4_rows(x, words, scales, offsets):
    """x (1, K) fp32; words (N/8, K/8, 8); scales and offsets (N/8, G, 8), offset = zero - 8 * scale -> (N,) fp32."""
    M, G = scales.shape[:2]
    g = x.shape[-1] // G
    bits = words.view(torch.int32).view(M, G, g // 8, ROWS)
    columns = x.view(G, g // 8, 8)
    sums = None
    for b in range(8):
        sum_b = (((bits >> (4 * b)) & 15).float() * columns[:, :, b].view(G, g // 8, 1)).sum(2)  # (M, G, 8)
        sums = sum_b if sums is None else sums + sum_b
    return (sums * scales + offsets * x.view(G, g).sum(-1).view(1, G, 1)).sum(1).view(-1)


def lane_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-(row, group) scales (N, G) as packed_rows reads them: (8 [2p + s], N/64, 2 [h], G, 8 [lane]), lane l
    of extraction (p, s) holding row h*32 + s*16 + 4*(l % 4) + p (lanes l and l + 4: the same row, two columns)."""
    N, G = scales.shape
    t = scales.view(N // 64, 2, 2, 4, 4, G).permute(4, 2, 0, 1, 5, 3)  # (p, s, block, h, G, w): row h*32+s*16+4w+p
    return t.unsqueeze(-2).expand(4, 2, N // 64, 2, G, 2, 4).reshape(8, N // 64, 2, G, 8).contiguous()


def packed_rows(x, words, scales, scales_and_zeros_by_row):
    """One row times torch's own CPU packing (int4.unpack's layout), its bytes read as float32 words, eight words
    = two columns of sixteen rows: x (1, K) fp32; words (N/64, 2, K/2, 8); scales from lane_scales;
    scales_and_zeros_by_row (N, 2, G), for the offsets' sums (zero - 8 * scale) times each group's sum of x."""
    B, _, K2, _ = words.shape
    G = scales.shape[3]
    bits = words.view(torch.int32).view(B, 2, G, K2 // G, 8)
    columns = x.view(G, K2 // G, 2, 1).expand(G, K2 // G, 2, 4).reshape(G, K2 // G, 8)  # lane l: column 2k2 + l // 4
    rows = []
    for p in range(4):  # the byte of the word
        for s in range(2):  # its low or high nibble
            sums = (((bits >> (8 * p + 4 * s)) & 15).float() * columns).sum(3)  # (B, 2, G, 8)
            rows.append((sums * scales[2 * p + s]).sum(2).view(B, 2, 2, 4).sum(2))  # (B, 2, 4): lanes l, l+4 added
    y = torch.stack(rows).view(4, 2, B, 2, 4).permute(2, 3, 1, 4, 0).reshape(-1)  # row h*32 + s*16 + 4w + p
    scale, zero = scales_and_zeros_by_row[:, 0], scales_and_zeros_by_row[:, 1]  # (N, G)
    return y + ((zero - 8 * scale) * x.view(G, -1).sum(-1)).sum(-1)


def seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matrices(N: int, K: int, copies: int):
    """`copies` random (N, K) matrices quantized: their codes and scales_and_zeros, the words layout's
    (words, scales, offsets), and torch's packing with bf16 scales_and_zeros."""
    codes, scales_and_zeros = zip(*(int4.quantize_groups(torch.randn(N, K) * 0.02, GROUP) for _ in range(copies)))
    offsets = [(sz[..., 1] - 8 * sz[..., 0]).t().contiguous() for sz in scales_and_zeros]  # zero - 8 * scale, (N, G)
    ours = [(pack_rows(q), by_rows(sz[..., 0].t().contiguous()), by_rows(o))
            for q, sz, o in zip(codes, scales_and_zeros, offsets)]  # fmt: skip
    theirs = [(int4.pack(q), sz.bfloat16()) for q, sz in zip(codes, scales_and_zeros)]
    return codes, scales_and_zeros, ours, theirs


def measure(N: int, K: int, copies: int, rounds: int) -> str:
    """One shape, one row: the three products on `copies` matrices, cycled; G weights/s a round, and their errors."""
    codes, scales_and_zeros, ours, theirs = matrices(N, K, copies)
    x = torch.randn(1, K)
    compiled = kernel(int4_rows, x, *ours[0])
    xb = x.bfloat16()
    exact = (x.double() @ int4.dequantize(codes[0], scales_and_zeros[0]).double().t())[0]

    def error(y: torch.Tensor) -> float:
        return ((y.double().view(-1) - exact).abs().max() / exact.abs().max()).item()

    # the loop over torch's packing: its scales laid out by lane and by row once, as a layer would keep them
    over_packing = [(p.view(torch.float32).view(N // 64, 2, K // 2, 8), lane_scales(sz[..., 0].t().contiguous()),
                     sz.permute(1, 2, 0).contiguous())
                    for p, sz in zip((t[0] for t in theirs), scales_and_zeros)]  # fmt: skip
    compiled_packed = kernel(packed_rows, x, *over_packing[0])
    line = []
    for _ in range(rounds):
        t_torch = seconds(lambda: [torch._weight_int4pack_mm_for_cpu(xb, p, GROUP, sz) for p, sz in theirs]) / copies
        t_rows = seconds(lambda: [compiled(x, *m) for m in ours]) / copies
        t_packed = seconds(lambda: [compiled_packed(x, *m) for m in over_packing]) / copies
        line.append(f"torch {N * K / t_torch / 1e9:5.1f}, rows {N * K / t_rows / 1e9:5.1f}, "
                    f"over torch's packing {N * K / t_packed / 1e9:5.1f}")  # fmt: skip
    torch_error = error(torch._weight_int4pack_mm_for_cpu(xb, theirs[0][0], GROUP, theirs[0][1]))
    errors = (f"error: torch {torch_error:.1e}, rows {error(compiled(x, *ours[0])):.1e}, "
              f"over torch's packing {error(compiled_packed(x, *over_packing[0])):.1e}")  # fmt: skip
    return " | ".join(line) + f"  ({errors})"


def several(N: int, K: int, rows: int) -> str:
    """rows rows through one matrix: the loop once per row against torch's kernel, ms."""
    _, _, ours, theirs = matrices(N, K, 1)
    x = torch.randn(rows, K)
    compiled = kernel(int4_rows, x[:1], *ours[0])
    xb = x.bfloat16()
    t_torch = seconds(lambda: torch._weight_int4pack_mm_for_cpu(xb, theirs[0][0], GROUP, theirs[0][1]))
    t_rows = seconds(lambda: [compiled(x[i : i + 1], *ours[0]) for i in range(rows)])
    return f"torch {t_torch * 1e3:6.1f} ms, rows once a row {t_rows * 1e3:6.1f} ms ({t_rows / t_torch:.1f}x)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=32, help="matrices of each shape, cycled (default 32)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", default=None, help="comma-separated row counts: several rows through 6144 x 1024 instead")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.rows:
        for rows in map(int, args.rows.split(",")):
            print(f"{rows:4d} rows: {several(6144, 1024, rows)}", flush=True)
        return
    print(f"{args.copies} matrices a shape, one row; G weights/s")
    for name, (N, K) in SHAPES.items():
        print(f"{name:8s} {N}x{K}: {measure(N, K, args.copies, args.rounds)}", flush=True)


if __name__ == "__main__":
    main()
