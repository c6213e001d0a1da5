"""int4 weights times int8 activations, two rows to a 32-bit lane: the pairs layout, int4's default on AVX2 CPUs.

llama.cpp's Q4_0 multiplies its 4-bit weights by activations rounded to int8 (a scale per 32 numbers) with
integer instructions. inductor's C++ loops have no 16-bit lanes and no byte dot products, but they multiply int32
lanes, and a lane can hold two rows' codes, one in each 16-bit half:

    word [m, G, w, r]: row 16m + r's columns 32G + 4w .. 32G + 4w + 3 in the nibbles of its low half (bits 0-15),
                       row 16m + 8 + r's same columns in its high half (bits 16-31)

(word >> 4b) & 0x000F000F holds column 4w + b's code of both rows, and times that column's int8 activation both
products land in their own half. Two nibble positions' products over a group's eight words stay within
+-2 * 8 * 15 * 127 = 30480 < 2**15 in the low half, so its sum comes back by sign extension ((s << 16) >> 16) and
the high half's by a shift: 16 weights for a shift, a mask, an int32 multiply and an add, where the words loop
(int4.py) takes two masks, two conversions and two fused multiply-adds.

Each row is rounded a group of GROUP at a time: d = max |x| / 127, x ~ d * round(x / d), as Q8_0 does. Then for
each row of the matrix and each group, with the group's codes q, scale s and offset o = zero - 8 s
(w = q * s + o, int4.py's convention):

    sum_c w_c x_c  ~  d * (s * sum_c q_c round(x_c / d) + o * sum_c round(x_c / d))

The integer sums are exact, so a product equals the float64 product of the dequantized matrix by the rounded
row to fp32 rounding (tests/test_int4_pairs.py); rounding the row moves it by ~0.5% (rms, relative: random
weights and rows, scripts/bench/int4_layouts_ab.py), where the int4 codes themselves move the 0.6B
shapes' logits by ~30%. A row's bits do not depend on the rows beside it. A prompt of
widen.MIN_INT4_WORDS_ROWS half-precision rows or more runs in fp32 over the matrix dequantized a block at a time
(as the words layout's does), on its rows rounded the same way: the same products to fp32 rounding, so whether an
engine's step packed a request among 64 rows or fewer moves its products by rounding only.

The default on a CPU whose widest vectors are AVX2's (AMD Zen 3, Intel before AVX-512), where it replaced the
words layout (int4.py) for group size 32 and rows in multiples of 16 (the words otherwise);
QWEN3_SCRATCH_INT4_LAYOUT=words keeps the words and their fp32 rows, =pairs asks for the pairs on any CPU. On an
AMD EPYC Zen 3 (2 threads, the 0.6B shapes) the 28 layers' two whole-half kernels took 19 ms a step against the
words' 25-26, and decode ran at 1.06x llama.cpp's Q4_0 against the words' 0.77x (docs/performance.md). Several
rows run in the words' blocks of 8, 4, 2 and 1 (block_product: the rows a dimension of the loop, each word unpacked
once for the block), 1.12-1.35x the words' speed at 2 to 16 rows.
"""

import torch

from . import int4
from .int4 import FUSED_MULTIPLY_ADD, NEVER_STORE, Int4Linear, compiler_works, words_scale_and_zero
from .matvec import as_buffer, cpu_reads_words, kernel

GROUP = 32  # columns a scale covers, for the weights and for the activations
WORDS = GROUP // 4  # a group's words: four columns a word
ROWS = 16  # rows a vector of eight words holds
LIMIT = 127  # the activations' codes: -127 .. 127


def holds(linear: torch.nn.Linear, group_size: int) -> bool:
    """Whether this CPU matrix is laid out in pairs: QWEN3_SCRATCH_INT4_LAYOUT=pairs asks, or it is unset on a CPU
    whose widest vectors are AVX2's (where the words layout was the default before); the matrix fits (group size
    32, rows in multiples of 16) and a compiler builds its loops."""
    layout = int4.chosen_layout(warn=False)
    asked = layout == "pairs" or (not layout and cpu_reads_words())
    return (asked and linear.weight.device.type == "cpu" and group_size == GROUP and linear.out_features % ROWS == 0
            and linear.in_features % GROUP == 0 and compiler_works())  # fmt: skip


def pairs_product(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x (R, K) fp32 times the matrix in the pairs layout -> (R, N) in the scales' dtype: words (N/16, K/32, 8, 8)
    float32 bits (pack_pairs), scales_and_zeros (N/16, K/32, 2, 8, 2) (pairs_scales) or bf16 ones as float32
    words (..., 1) (Int4Linear.scale_words). R is fixed when compiled: one row is row_product's loop (a decode
    step's), several block_product's (a batch, a short prompt). Both are the same expression for each row, so a
    row's bits are the same alone or among any others (tests/test_int4_pairs.py)."""
    product = row_product if x.shape[0] == 1 else block_product
    return product(x, words, scales_and_zeros)


def row_product(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """pairs_product for one row, x (1, K) -> (1, N).

    Each group's sums are written out word by word (a Python sum): as a reduction of eight, inductor stored them
    and read them back in a second loop, at 0.55x the words loop's speed; written out, one loop."""
    M, G = words.shape[:2]
    # every size given as a number (here and in `rounded`): the compiled kernel's loops then have known lengths
    # (left to the input's sizes, inductor kept M and the 8s as symbols of the kernel, at 0.3x the speed)
    bits = words.view(torch.int32).view(M, G, WORDS, 8)  # (row block, group, word, lane)
    row, d, x_sums = rounded(x, G)  # (1, G, WORDS, 4) int32, (1, G), (1, G)
    pair_sums = summed_pairs(bits, row, (1, G, 1))  # (M, G, 8) each
    return scaled(pair_sums, scales_and_zeros, d.view(1, G, 1), x_sums.view(1, G, 1), group_dim=1).view(1, -1)


def block_product(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """pairs_product for R > 1 rows, x (R, K) -> (R, N): the rows one more dimension of the same loop, which
    unpacks each word once for all of them (the rows written out one by one instead, each its own copy of
    row_product's sums, 8 rows took ~30 s to build and ran slower a row than one row alone). On an AMD EPYC
    Zen 3 (2 threads, 6144 x 1024, out of cache) 8 rows took 0.133 ms a row, one row 0.21-0.28, the words'
    blocks of 8 rows 0.145."""
    R = x.shape[0]
    M, G = words.shape[:2]
    bits = words.view(torch.int32).view(M, 1, G, WORDS, 8)  # (row block, row, group, word, lane)
    row, d, x_sums = rounded(x, G)  # (R, G, WORDS, 4), (R, G), (R, G)
    pair_sums = summed_pairs(bits, row, (1, R, G, 1))  # (M, R, G, 8) each
    y = scaled(pair_sums, scales_and_zeros.view(M, 1, *scales_and_zeros.shape[1:]), d.view(1, R, G, 1),
               x_sums.view(1, R, G, 1), group_dim=2)  # fmt: skip
    return y.view(M, R, ROWS).transpose(0, 1).reshape(R, M * ROWS)


def summed_pairs(bits: torch.Tensor, row: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The two pair sums of every group, (..., G, 8) int32 each: nibbles 0 and 1, then 2 and 3 (each pair's sums stay
    within a half), row A's sum + 65536 * row B's. bits (..., G, WORDS, 8) the matrix's words, row (..., G, WORDS, 4)
    the rows' codes, each column's viewed as `shape` to broadcast against a word of bits."""
    pair_sums = []
    for first in (0, 2):
        total = None
        for b in (first, first + 1):
            for w in range(WORDS):
                codes = ((bits[..., w, :] >> (4 * b)) if b else bits[..., w, :]) & 0x000F000F
                term = codes * row[..., w, b].view(shape)
                total = term if total is None else total + term
        pair_sums.append(total)
    return pair_sums


def scaled(pair_sums: list[torch.Tensor], scales_and_zeros: torch.Tensor, d: torch.Tensor, x_sums: torch.Tensor,
           group_dim: int) -> torch.Tensor:  # fmt: skip
    """The two pair sums (..., G, 8) int32 (G at group_dim) -> the products (..., 2, 8) in the scales' dtype, row
    16m + 8h + r at [m, ..., h, r]: each half's sums taken out of the lanes, times the group's scale plus its offset
    times the row's sum of codes, times the row's scale d, summed over the groups. scales_and_zeros broadcasts
    against the sums, (..., G, 2, 8, 2 | 1)."""
    paired = scales_and_zeros.shape[-1] == 1  # bf16 scales viewed as words: the activations are bf16
    # (..., G, 2, 8) fp32 each: [..., 0, r] row A's, [..., 1, r] row B's
    scale, zero = words_scale_and_zero(scales_and_zeros)
    offset = zero - 8 * scale
    low = [(s << 16) >> 16 for s in pair_sums]  # row A's, sign-extended
    sums = (low[0] + low[1], ((pair_sums[0] - low[0]) >> 16) + ((pair_sums[1] - low[1]) >> 16))  # A's, B's
    # each half's rows summed over the groups on their own, then side by side (stacked before the sum over
    # the groups, the integer sums were stored and read back by a second loop)
    y = [((sums[h].float() * scale.select(-2, h) + offset.select(-2, h) * x_sums) * d).sum(group_dim) for h in (0, 1)]
    return torch.stack(y, -2).to(torch.bfloat16 if paired else scales_and_zeros.dtype)


pairs_product.inductor_config = {**NEVER_STORE, **FUSED_MULTIPLY_ADD}


def row_codes(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x (R, K) fp32 of `groups` groups each -> their codes (R, groups, GROUP) fp32 whole numbers in
    [-LIMIT, LIMIT] and each group's scale d (R, groups): a row is d * codes (a group of zeros: codes 0)."""
    R = x.shape[0]
    x = x.view(R, groups, GROUP)
    d = x.abs().amax(-1) / LIMIT
    codes = torch.round(x / d.clamp(min=torch.finfo(torch.float32).tiny).view(R, groups, 1)).clamp(-LIMIT, LIMIT)
    return codes, d


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows x (R, K) fp32 as the loops multiply them, d * codes, fp32 (K a multiple of GROUP)."""
    codes, d = row_codes(x, x.shape[1] // GROUP)
    return (codes * d[..., None]).view(x.shape)


def rounded(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loops' rows, traced into their kernels: row_codes' codes as (R, groups, WORDS, 4) int32, each group's scale
    d (R, groups) and each group's sum of codes (R, groups) fp32."""
    R = x.shape[0]
    codes, d = row_codes(x, groups)
    # stored once: left inline, every block of 16 rows of the matrix divided and rounded the row again, 32 divisions a
    # group (0.4x the speed)
    codes_int = as_buffer(codes.to(torch.int32).view(R, groups, WORDS, 4))
    return codes_int, d, codes.sum(-1)


def matvec_int4_pairs(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """One row, x (1, K) fp32 -> (N,): pairs_product, as a whole-half kernel traces it (cpu_decode.py)."""
    return pairs_product(x, words, scales_and_zeros).view(-1)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) in [0, 15] (whole numbers, any dtype), N a multiple of 16, K of 32 -> words (N/16, K/32, 8, 8)
    int32, the module docstring's layout."""
    N, K = codes.shape
    c = codes.to(torch.int32).view(N // ROWS, 2, 8, K // 4, 4)  # (m, half, r, j, b)
    word = None
    for half in range(2):
        for b in range(4):
            part = c[:, half, :, :, b] << (16 * half + 4 * b)  # (m, r, j); bit 31 is a bit pattern, as in int4.py
            word = part if word is None else word | part
    return word.transpose(1, 2).reshape(N // ROWS, K // GROUP, WORDS, 8).contiguous()


def pairs_scales(scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """scales_and_zeros (K/32, N, 2) -> (N/16, K/32, 2, 8, 2): [m, G, half, r] row 16m + 8 half + r's pair."""
    G, N, _ = scales_and_zeros.shape
    return scales_and_zeros.view(G, N // ROWS, 2, 8, 2).transpose(0, 1).contiguous()


def pack_pairs_chunk(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4.quantize_codes' output laid out as pairs: a load's loop (matvec.stored_kernel), pack_pairs' bits."""
    return pack_pairs(codes), pairs_scales(scales_and_zeros)


def unpack_pairs(words: torch.Tensor) -> torch.Tensor:
    """pack_pairs undone: (n/16, K/32, 8, 8) int32 -> codes (n, K) uint8 (tests: the layout's reference)."""
    m, G = words.shape[:2]
    fields = [(words >> (16 * half + 4 * b)) & 15 for half in range(2) for b in range(4)]
    nibbles = torch.stack(fields, -1).view(m, G, WORDS, 8, 2, 4)  # (m, G, w, r, half, b)
    return nibbles.permute(0, 4, 3, 1, 2, 5).reshape(m * ROWS, G * GROUP).to(torch.uint8)


SHIFTS = (16 * torch.arange(2, dtype=torch.int32)[:, None] + 4 * torch.arange(4, dtype=torch.int32)).view(2, 4)


def dequantize_pairs_transposed(words: torch.Tensor, scales_and_zeros: torch.Tensor,
                                shifts: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The rows a block of pairs stands for, transposed: (K, n) fp32, [c, row] = that row's weight of column c,
    from words (n/16, K/32, 8, 8) float32 bits and their scales_and_zeros; shifts is SHIFTS (a long prompt's
    product, Int4Linear.widened_words)."""
    m, G = words.shape[:2]
    bits = words.view(torch.int32).view(m, G, WORDS, 1, 8, 1)  # (m, G, w, half, r, b)
    q = ((bits >> shifts.view(1, 1, 1, 2, 1, 4)) & 15).float()  # (m, G, w, half, r, b)
    scale, zero = words_scale_and_zero(scales_and_zeros)  # (m, G, half, r)
    w = (q - 8) * scale.view(m, G, 1, 2, 8, 1) + zero.view(m, G, 1, 2, 8, 1)
    return w.permute(1, 2, 5, 0, 3, 4).reshape(G * GROUP, m * ROWS)  # (G, w, b, m, half, r)


class Int4PairsLinear(Int4Linear):
    """An Int4Linear whose CPU loop rounds its rows to int8 and holds two rows' codes in each 32-bit lane (the module
    docstring); .words is True, as for the words layout: the same machinery (blocks of rows, long prompts widened,
    the decode halves) over this layout's loops. quantize_model makes one where `holds` says so."""

    # several rows in the words' blocks of 8, 4, 2 and 1 (int4.ROW_BLOCKS), a block of more than one through
    # block_product: the 0.6B shapes' 28 layers' products took 1/1.19-1.35 of the words' time at 2 and 4 rows, 1/1.18
    # at 8, 1/1.12 at 16 (Zen 3, 2 threads; scripts/bench/int4_layouts_ab.py --rows R)
    loop, rows_per_vector = staticmethod(pairs_product), ROWS

    def quantize(self, weight: torch.Tensor, words: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        self.words = True
        return int4.quantize_and_pack(weight, self.group_size, layout=pack_pairs_chunk)

    @staticmethod
    def dequantize_transposed(words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        dequantize = kernel(dequantize_pairs_transposed, words, scales_and_zeros, SHIFTS)
        return dequantize(words, scales_and_zeros, SHIFTS)

    def widened_words(self, rows: torch.Tensor) -> torch.Tensor:
        """A long prompt's rows (R, K) fp32, rounded as the loops round them, times the matrix in fp32: the loops'
        products to fp32 rounding (unrounded, the words' way, a request's products moved ~0.5% whenever an engine
        step packed it among 64 rows or more)."""
        return super().widened_words(rounded_rows(rows))  # eagerly: `rounded` is for tracing (it imports inductor)
