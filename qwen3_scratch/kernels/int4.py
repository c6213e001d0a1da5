"""int4 weight-only quantization with group-wise scales and zero points, computed at load time.

Batch-1 decode reads every weight once per token, so four bits a weight read a quarter of bf16's bytes.
Each row of a matrix is cut into groups of `group_size` consecutive weights (32 by default, as
llama.cpp's Q4_0; 64 and 128 read fewer scale bytes and lose more accuracy), and each group keeps its
own scale and zero point:

    lo, hi = min and max of the group      scale = (hi - lo) / 15      q = round((w - lo) / scale) in [0, 15]
    w ~ (q - 8) * scale + zero,  zero = lo + 8 * scale                 (torch's int4 kernels' convention)

Asymmetric (a zero point per group) rather than symmetric (Q4_0's max-magnitude scale): measured on the
Qwen3-0.6B shapes against bf16 (scripts/bench/quant_accuracy.py), it gave the smaller logit error at every group
size (rms relative error at group 32: 0.33 against 0.36; max error 0.36 against 0.37), twice the argmax
agreement at groups 64 and 128 and one position of 64 less at 32 (random weights: near-ties), and torch's
kernel reads a zero point whether we use it or not, so it costs no bytes.

The products run torch's own int4 kernels on the packed nibbles: `_weight_int4pack_mm_for_cpu` (any
number of rows, so prefill and serving batches too) and `_weight_int4pack_mm` on CUDA. On this project's
CPU (2-core AMD EPYC, Zen 4) the CPU kernel with bf16 activations read 15-19 GB/s of int4 weights where
an inductor-compiled loop that unpacks two nibbles, widens and multiply-adds (matvec.py's machinery) read
5-9 (scripts/bench/benchmark_matvec.py; docs/performance.md). With fp32 activations torch's CPU kernel is exact but slow here
(~0.6 GB/s): int4 is meant to run with bf16 activations, what `--dtype auto` picks with quantized weights on any CPU
(checkpoint/placement.py).

On a CPU without bf16 instructions, a prompt of MIN_INT4_ROWS rows or more runs in fp32 instead, over the same
packed nibbles unpacked a block at a time (widen.py): 1.2-1.3x faster at 300 rows on an AMD EPYC Zen 3. On a CPU
with them, such a prompt runs over blocks dequantized to bf16 (Int4Linear.dequantized_product): 1.4x at 300 rows on
an AMD EPYC Zen 5.

On a CPU whose widest vectors are AVX2's, torch's int4 kernel is bound by its compute (11-14 G weights/s on two
Zen 3 cores, where the memory streams ~50 G nibbles/s), and the codes are laid out for a loop of our own instead
(`words`, words_product): eight nibbles to a 32-bit word (nibble b of word j: column 8j + b, so a word lies inside
one group), the words of eight rows side by side (a vector of fp32 holds eight rows, and the row's activation is
one broadcast number), read as float32 (the only load at::vec does at full speed there, as for int8's words).
One row: 23-28 G weights/s on the 0.6B shapes (14-20 before its products were fused multiply-adds, each nibble
read in place, and bf16 scales read as words) against torch's 11-14. Several rows go through the same loop in
blocks of 8, 4, 2 and 1 (ROW_BLOCKS), each word unpacked once for the block: about torch's kernel's speed. From
widen.MIN_INT4_WORDS_ROWS bf16 rows on, a product in fp32 over the words dequantized a block at a time,
transposed (dequantize_words_transposed). Exact in fp32 (no weight is rounded to bf16), and a row's bits do not
depend on the rows beside it. docs/performance.md has the figures; scripts/bench/int4_rows_ab.py the one-row loop.

On such a CPU the default for group size 32 is now a third layout, whose loops round each activation row to int8
codes as llama.cpp's Q4_0 does and multiply in int32 lanes holding two rows' codes each (int4_pairs.py): faster at
one row and at eight, not exact in the rows. QWEN3_SCRATCH_INT4_LAYOUT=words keeps the words.

Exactness: the kernel dequantizes each weight to the activations' dtype and sums in fp32, so with fp32
activations its logits equal the model whose matrices are `dequantize(...)` to 1e-5 relative
(tests/test_int4.py); with bf16 activations they differ from that by bf16 rounding.

Shapes: N out_features, K in_features, g group_size.
"""

import functools
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_scratch.errors import CheckpointError

from . import widen
from .matvec import cpu_reads_words, kernel, stored_kernel, unavailable_reason

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
# torch's packing parameter for the CUDA kernel (tinygemm: 2, 4 or 8 tiles of 16 along K per inner step); 8,
# as gpt-fast packs, reads the longest runs per load, and needs K to be a multiple of 128 (every Qwen3 matrix
# is), else 2 (a multiple of 32). The CPU packing ignores it.
INNER_K_TILES = (8, 2)
PACK_ROWS = 64  # torch's CPU packing lays rows out in blocks of 64 (see unpack)
ROWS = 8  # rows side by side in the words layout: one AVX2 vector of fp32 (pack_words)
LAYOUTS = ("words", "pairs", "torch")  # QWEN3_SCRATCH_INT4_LAYOUT's values (pairs: int4_pairs.py)


def chosen_layout(warn: bool = True) -> str:
    """QWEN3_SCRATCH_INT4_LAYOUT's value, or "" when unset (a value not in LAYOUTS: "", and a warning if `warn`:
    words_by_default gives it, once for the run)."""
    choice = os.environ.get("QWEN3_SCRATCH_INT4_LAYOUT", "").strip().lower()
    if choice and choice not in LAYOUTS:
        if warn:
            warnings.warn(f"QWEN3_SCRATCH_INT4_LAYOUT={choice!r} is not one of {', '.join(LAYOUTS)}; ignored",
                          stacklevel=3)  # fmt: skip
        choice = ""
    return choice


def words_by_default() -> bool:
    """Whether a CPU Int4Linear keeps the words layout: QWEN3_SCRATCH_INT4_LAYOUT=words or =torch (torch's packing
    and kernel) when set (=pairs: words for a matrix the pairs cannot hold), else on a CPU whose widest vectors are
    AVX2's (matvec.cpu_reads_words; there int4_pairs.holds takes the matrices the pairs hold first)."""
    choice = chosen_layout()
    return choice in ("words", "pairs") if choice else cpu_reads_words()


def quantize_groups(weight: torch.Tensor, group_size: int, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> codes (N, K) int32 in [0, 15] and scales_and_zeros (K/g, N, 2) fp32 (tests, references)."""
    chunks = [quantize_chunk(weight[i : i + rows_per_chunk], group_size=group_size) for i in range(0, len(weight), rows_per_chunk)]
    return torch.cat([q for q, _ in chunks]), torch.cat([sz for _, sz in chunks], dim=1)


def quantize_and_pack(weight: torch.Tensor, group_size: int, rows_per_chunk: int = 4096, words: bool = False,
                      layout=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(N, K) float -> packed codes for torch's kernel and scales_and_zeros (K/g, N, 2) fp32; with `words`, the
    codes as pack_words lays them out and scales_and_zeros as words_scales does.

    In chunks of rows (a multiple of torch's 64-row packing blocks, so packing chunk by chunk equals packing
    the whole), so no int32 or fp32 temporary of a 151936-row lm_head ever exists whole: quantize_codes, then
    pack_words_chunk for the words (or `layout`, another such loop: int4_pairs.pack_pairs_chunk). On a CPU each runs
    its stored kernel once an earlier start has stored it
    (0.82 s for the 0.6B shapes on an AMD EPYC Zen 3); until then eagerly (~6 s), the same bits: building its
    kernels (~2.5 s each, ten for the 0.6B shapes' words) would cost a first start more.
    """
    layout = layout or (pack_words_chunk if words else None)  # None: torch's packing
    packed, scales_and_zeros = [], []
    for start in range(0, len(weight), rows_per_chunk):
        w = weight[start : start + rows_per_chunk].contiguous()  # (n, K)
        stored = stored_kernel(quantize_codes, w, group_size=group_size)
        codes, sz = stored(w) if stored is not None else quantize_codes(w, group_size=group_size)
        if layout is not None:
            stored = stored_kernel(layout, codes, sz)
            codes, sz = stored(codes, sz) if stored is not None else layout(codes, sz)
        else:
            codes = pack(codes.to(torch.int32))
        packed.append(codes)
        scales_and_zeros.append(sz)
    return torch.cat(packed), torch.cat(scales_and_zeros, dim=1 if layout is None else 0)


def quantize_codes(w: torch.Tensor, *, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (n, K) -> codes (n, K) in [0, 15] and scales_and_zeros (K/g, n, 2) fp32, as the module docstring says.

    The codes are whole numbers kept as fp32: a loop over bf16 runs 16 lanes wide, and at::vec converts 16 fp32
    lanes to int32 one lane at a time on AVX2, which took two thirds of this loop's time; the packing converts
    them 8 lanes at a time, in one instruction."""
    n, K = w.shape
    groups = w.float().view(n, K // group_size, group_size)  # (n, K/g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)  # (n, K/g)
    scale = ((hi - lo) / 15).clamp(min=1e-12)  # a constant group keeps a tiny scale, not a division by 0
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)  # (n, K/g, g)
    return q.view(n, K), torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1)  # (K/g, n, 2)


def quantize_chunk(w: torch.Tensor, *, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_codes with the codes as int32 (tests, references)."""
    codes, scales_and_zeros = quantize_codes(w, group_size=group_size)
    return codes.to(torch.int32), scales_and_zeros


def pack_words_chunk(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_codes' output laid out for the words loop: codes (n, K) -> words (n/8, K/8, 8) int32 (pack_words'
    layout) and scales_and_zeros (K/g, n, 2) -> (n/8, K/g, 8, 2) (words_scales).

    Each row's words first, eight codes ORed at their shifts (nibble 7 reaches the sign bit: a bit pattern, as
    pack_words' int64 sum keeps it), then eight rows' words side by side. quantize_codes and this loop take 3.4 ms
    for 4096 x 1024 bf16 on an AMD EPYC Zen 3, one loop with pack_words' sum over the nibbles 7.9 (inductor
    reduced it across the lanes once per word, after converting each code to int64)."""
    n, K = codes.shape
    c = codes.to(torch.int32).view(n, K // 8, 8)  # (n, j, b)
    word = c[..., 0]
    for b in range(1, 8):
        word = word | (c[..., b] << (4 * b))  # (n, j)
    return word.view(n // ROWS, ROWS, K // 8).transpose(1, 2).contiguous(), words_scales(scales_and_zeros)


def compiler_works() -> bool:
    return unavailable_reason() is None


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """codes (N, K) in [0, 15], scales_and_zeros (K/g, N, 2) -> the matrix they stand for, (N, K) fp32."""
    N, K = codes.shape
    groups = scales_and_zeros.shape[0]
    scale, zero = scales_and_zeros.float().permute(2, 1, 0)  # (N, K/g) each
    q = codes.float().view(N, groups, K // groups)  # (N, K/g, g)
    return ((q - 8) * scale[..., None] + zero[..., None]).view(N, K)


def check_group_size(group_size: int, in_features: int, name: str) -> None:
    if group_size not in GROUP_SIZES:
        raise CheckpointError(f"--quantize-group-size {group_size} is not supported; use one of "
                              f"{', '.join(map(str, GROUP_SIZES))}")  # fmt: skip
    if in_features % group_size:
        raise CheckpointError(f"--quantize-group-size {group_size} does not divide the {in_features} inputs of "
                              f"{name}; use a smaller group size (32 divides every Qwen3 matrix)")  # fmt: skip


class Int4Linear(nn.Module):
    """y = x @ dequantize(codes, scales_and_zeros).T, with the codes packed two to a byte: for torch's kernel, or
    as words (the module docstring) on a CPU with AVX2 only (`words`: None decides by the CPU)."""

    scheme = "int4"  # what the stats line calls these weights (their tensor is packed bytes: uint8, or words)

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, group_size: int, words: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.split_sizes = getattr(linear, "split_sizes", None)
        packed, scales_and_zeros = self.quantize(linear.weight.detach(), words)
        # torch's packing: (N, K/2) uint8, opaque; words: (N/8, K/8, 8) int32
        self.weight = nn.Parameter(packed, requires_grad=False)
        # (K/g, N, 2) for torch's kernel; words: (N/8, K/g, 8, 2)
        self.scales_and_zeros = nn.Parameter(scales_and_zeros.to(dtype), requires_grad=False)
        self.bias = linear.bias
        if self.words:  # the one-row kernel now: a broken toolchain shows at load (blocks of rows: on first use)
            self.block_kernel(torch.empty(1, self.in_features))

    # the rows a vector of the words holds, and (set below words_product) the loop over them: another layout of
    # words has its own (int4_pairs.Int4PairsLinear), as it has its own dequantize_transposed for long prompts
    rows_per_vector = ROWS

    def quantize(self, weight: torch.Tensor, words: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes in the layout this CPU reads best (sets .words) and their scales_and_zeros."""
        words = words_by_default() if words is None else words
        cpu = weight.device.type == "cpu"
        self.words = words and cpu and self.out_features % ROWS == 0 and compiler_works()
        return quantize_and_pack(weight, self.group_size, words=self.words)

    @staticmethod
    def dequantize_transposed(words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        return kernel(dequantize_words_transposed, words, scales_and_zeros, SHIFTS)(words, scales_and_zeros, SHIFTS)

    @property
    def codes(self) -> torch.Tensor:
        """What the one-row loop reads (words): the words as float32 bits."""
        return self.weight.view(torch.float32)

    @property
    def scale_words(self) -> torch.Tensor:
        """What the words loop reads for scales_and_zeros (words_scale_and_zero): in bf16, each lane's scale and zero
        as one float32 word, (N/8, K/g, 8, 1), a view; otherwise the tensor itself."""
        sz = self.scales_and_zeros
        return sz.view(torch.float32) if sz.dtype == torch.bfloat16 else sz

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B*T, K); the kernels read rows densely, and a view such as forward's last_only slice x[:, -1:] is not
        rows = x.reshape(-1, self.in_features).contiguous()
        if self.words:
            y = self.words_product(rows)
        elif x.is_cuda:
            y = torch._weight_int4pack_mm(rows, self.weight, self.group_size, self.scales_and_zeros)
        elif not self.out_features % PACK_ROWS and widen.widens(rows, self.in_features, widen.MIN_INT4_ROWS):
            y = widen.products(rows, self.out_features, self.widened_block).to(rows.dtype)  # fp32, rounded once
        elif not self.out_features % PACK_ROWS and self.dequantizes(rows):
            y = self.dequantized_product(rows)
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scales_and_zeros)
        y = y.view(*x.shape[:-1], self.out_features)  # (..., N)
        return y if self.bias is None else y + self.bias

    def block_kernel(self, block: torch.Tensor):
        """words_product compiled for blocks of rows of this one's shape, (R, K) fp32 (matvec.kernel keeps it)."""
        return kernel(self.loop, block, self.codes, self.scale_words)

    def words_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (R, K) times the matrix in the words layout -> (R, N) in the rows' dtype: blocks of ROW_BLOCKS
        rows through words_product's compiled loop (about torch's kernel's speed from 2 rows, faster at 1), or from
        MIN_INT4_WORDS_ROWS half-precision rows in fp32 over the words dequantized a block at a time."""
        if torch.compiler.is_compiling():  # traced into the caller's graph (a whole-half kernel, torch.compile)
            return self.loop(rows.float(), self.codes, self.scale_words).to(rows.dtype)
        if len(rows) >= widen.MIN_INT4_WORDS_ROWS and rows.dtype in widen.HALF:
            return self.widened_words(rows.float()).to(rows.dtype)
        wide, out = rows.float(), [rows.new_empty(0, self.out_features)]  # (no rows: no product)
        codes, scales = self.codes, self.scale_words  # (views, taken once)
        for start, size in row_blocks(len(rows)):
            block = wide[start : start + size]
            out.append(self.block_kernel(block)(block, codes, scales))
        return (out[1] if len(out) == 2 else torch.cat(out)).to(rows.dtype)

    def widened_words(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (R, K) fp32 times the matrix in the words layout, in fp32 -> (R, N): widen.products' way, a block
        of widen.BLOCK_ROWS rows of the matrix at a time dequantized, but transposed (K, rows of the block), as
        the words lie: each vector of eight rows is one load, shifted (1.4 G weights/s against 0.5 for the (N, K)
        block on the AMD EPYC Zen 3; docs/performance.md), and MKL multiplies by either layout as fast."""
        y = torch.empty(len(rows), self.out_features)
        rows_per_vector = self.rows_per_vector
        step = widen.BLOCK_ROWS // rows_per_vector  # row blocks of the words
        for start in range(0, len(self.weight), step):
            words, scales_and_zeros = self.codes[start : start + step], self.scale_words[start : start + step]
            block = self.dequantize_transposed(words, scales_and_zeros)
            torch.mm(rows, block, out=y[:, start * rows_per_vector : start * rows_per_vector + block.shape[1]])
        return y

    def dequantizes(self, rows: torch.Tensor) -> bool:
        """Whether rows (R, K) run dequantized_product: widen.MIN_INT4_ROWS bf16 rows or more on a CPU with bf16
        instructions, outside a traced graph."""
        return (rows.device.type == "cpu" and rows.dtype == torch.bfloat16 and len(rows) >= widen.MIN_INT4_ROWS
                and widen.cpu_has_native_bf16() and not torch.compiler.is_compiling())  # fmt: skip

    def dequantized_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (R, K) bf16 times the matrix -> (R, N) bf16 on a CPU with bf16 instructions: a block of
        widen.BLOCK_ROWS rows of the matrix at a time dequantized to bf16 (dequantize_block: each weight rounded to
        bf16 once, as torch's kernel rounds it for bf16 rows) and multiplied by oneDNN's bf16 product. torch's
        kernel unpacks and dequantizes its weights again for every few rows: on an AMD EPYC Zen 5 (2 threads) at
        300 rows it took 23.0 ms for a 6144 x 1024 matrix and 8.0 for 1024 x 3072, this 15.6 and 5.7, from its
        stored dequantizing kernels (slower below ~150 rows; docs/performance.md). Until an earlier start has stored
        them (matvec.stored_kernel), the dequantizing runs eagerly, with the same bits and about torch's speed."""
        y = rows.new_empty(len(rows), self.out_features)
        layout = cpu_packing()
        for start in range(0, self.out_features, widen.BLOCK_ROWS):
            packed = self.weight[start : start + widen.BLOCK_ROWS]
            scales_and_zeros = self.scales_and_zeros[:, start : start + widen.BLOCK_ROWS].contiguous()
            stored = stored_kernel(dequantize_block, packed, scales_and_zeros, layout=layout)
            block = (stored(packed, scales_and_zeros) if stored is not None
                     else dequantize_block(packed, scales_and_zeros, layout=layout))  # fmt: skip
            y[:, start : start + len(packed)] = F.linear(rows, block)
        return y

    def widened_block(self, block: torch.Tensor, start: int, end: int) -> None:
        """Rows start:end of the matrix, dequantized in fp32 into block (widen.products' fill): a prompt on a CPU
        without bf16 instructions. torch's kernel rounds each dequantized weight to the rows' dtype; these stay
        fp32, so the product is nearer the exact one."""
        block.copy_(dequantize(unpack(self.weight[start:end]), self.scales_and_zeros[:, start:end]))


def words_product(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x (R, K) fp32 times the int4 matrix in the words layout -> (R, N) in the scales' dtype: words (N/8, K/8, 8)
    float32 bits (pack_words), scales_and_zeros (N/8, K/g, 8, 2) (words_scales), or bf16 ones as float32 words
    (N/8, K/g, 8, 1) (Int4Linear.scale_words). R is fixed when compiled.

    For each group of g columns and each row, sum q * x in fp32 over the group, then times the group's scale,
    plus (zero - 8 * scale) times the group's sum of x: the product of the dequantized matrix. Each nibble
    position b has its own accumulator (eight independent sums of g/8 words; one sum of all eight nibbles was
    15-20% slower, each word waiting on the last one's adds). The rows are a Python loop, so the compiled
    kernel unpacks each word once for all R of them (inductor keeps one copy of an expression the rows share),
    and each row's sums are the same expression whatever R is: a row's bits do not depend on its neighbours."""
    R, K = x.shape
    M = words.shape[0]
    G, g = scales_and_zeros.shape[1], K // scales_and_zeros.shape[1]
    bits = words.view(torch.int32).view(M, G, g // 8, ROWS)  # (row block, group, word of the group, row)
    columns = x.view(R, G, g // 8, 8)  # columns[r, group, word, b]: row r's number for nibble b's column
    scale, zero = words_scale_and_zero(scales_and_zeros)  # (M, G, 8) fp32 each
    offsets = zero - 8 * scale
    x_sums = x.view(R, G, g).sum(-1)  # (R, G)
    # nibble b read in place, q * 16**b, with a mask alone (the top one shifted down: in place it holds the sign
    # bit), and its sums times 16**-b: a power of two rounds nothing (short of fp32's overflow and underflow), so
    # these are the bits of each nibble shifted down first, one instruction a nibble fewer (1.1x the speed)
    out = []
    for r in range(R):
        sums = None
        for b in range(8):
            nibbles = (bits & (15 << (4 * b))).float() if b < 7 else ((bits >> 28) & 15).float()
            sum_b = (nibbles * columns[r, :, :, b].view(G, g // 8, 1)).sum(2)  # (M, G, 8)
            sum_b = sum_b * 16.0**-b if 0 < b < 7 else sum_b
            sums = sum_b if sums is None else sums + sum_b
        out.append((sums * scale + offsets * x_sums[r].view(1, G, 1)).sum(1).view(-1))
    paired = scales_and_zeros.shape[-1] == 1  # bf16 scales viewed as words: the activations are bf16
    return torch.stack(out).to(torch.bfloat16 if paired else scales_and_zeros.dtype)


# Nothing stored between the unpacking and the sums: by default inductor stores a buffer once its expression
# grows, and with several rows it stored the unpacked nibbles (2-3x slower; docs/performance.md)
NEVER_STORE = {name: 1 << 20 for name in ("realize_reads_threshold", "realize_opcount_threshold",
                                          "realize_cpu_opcount_threshold", "realize_acc_reads_threshold",
                                          "realize_cpu_acc_reads_threshold")}  # fmt: skip
# Each product added with one fused multiply-add (the C++ compiler contracts `sum + q * x`; inductor's default keeps
# them apart, to round as eager does): with the mask above, 3 vector instructions a nibble (mask, convert, FMA)
# where there were 5, and 1.2x the weights a second on an AMD EPYC Zen 3. The product is rounded once, not twice,
# so the sums are as near the exact ones or nearer (docs/performance.md). The bits are still one loop's: every
# kernel that runs it (the blocks of rows, the decode halves of cpu_decode.py) is built so.
FUSED_MULTIPLY_ADD = {"cpp.enable_floating_point_contract_flag": "fast"}
words_product.inductor_config = {**NEVER_STORE, **FUSED_MULTIPLY_ADD}
Int4Linear.loop = staticmethod(words_product)  # the words layout's loop (int4_pairs.Int4PairsLinear has its own)
ROW_BLOCKS = (8, 4, 2, 1)  # several rows run as blocks of these many, one compiled kernel each


def row_blocks(rows: int) -> list[tuple[int, int]]:
    """(start, size) of each block `rows` rows run as: ROW_BLOCKS' sizes, largest first."""
    blocks, start = [], 0
    for size in ROW_BLOCKS:
        while rows - start >= size:
            blocks.append((start, size))
            start += size
    return blocks


def words_scale_and_zero(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and the zeros, (M, G, 8) fp32 each, of scales_and_zeros (M, G, 8, 2), or of bf16 ones viewed as
    float32 words (M, G, 8, 1) (Int4Linear.scale_words): a lane's scale and zero in one word, loaded as one vector
    of eight lanes and widened by moving bits (a bf16 is the high half of its fp32). at::vec loads eight bf16
    through a copy on the stack on AVX2, and the words loop ran at 0.6-0.8x this speed that way; the view is taken
    outside the kernels, because a view between sizes inside a graph is not fused (docs/performance.md). The same
    numbers as .float()."""
    if scales_and_zeros.shape[-1] == 2:
        return scales_and_zeros[..., 0].float(), scales_and_zeros[..., 1].float()
    pairs = scales_and_zeros.view(torch.int32).squeeze(-1)  # (M, G, 8): the scale in the low half, little-endian
    return (pairs << 16).view(torch.float32), (pairs & -65536).view(torch.float32)


def matvec_int4_words(x: torch.Tensor, words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """One row, x (1, K) fp32 -> (N,): words_product, as a whole-half kernel traces it (cpu_decode.py)."""
    return words_product(x, words, scales_and_zeros).view(-1)


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) in [0, 15], N a multiple of ROWS -> words (N/8, K/8, 8) int32: [m, j, r] holds row 8m + r's
    columns 8j .. 8j + 7, column 8j + b in nibble b (tests: the layout's reference; a load packs with
    pack_words_chunk)."""
    N, K = codes.shape
    c = codes.view(N // ROWS, ROWS, K // 8, 8).permute(0, 2, 1, 3).long()  # (m, j, r, b)
    # the nibbles' bits do not overlap, so their sum is their OR; nibble 7 reaches bit 31, so the sum is taken in
    # int64 and its low 32 bits kept
    return (c << torch.arange(0, 32, 4, device=c.device)).sum(-1).to(torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """pack_words undone: (n/8, K/8, 8) int32 -> codes (n, K) uint8 (tests: the layout's reference)."""
    m, J, _ = words.shape
    nibbles = torch.stack([(words >> (4 * b)) & 15 for b in range(8)], dim=-1)  # (m, j, r, b)
    return nibbles.permute(0, 2, 1, 3).reshape(m * ROWS, J * 8).to(torch.uint8)


def words_scales(scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """scales_and_zeros (K/g, N, 2) as the words layout reads them: (N/8, K/g, 8, 2), eight rows' (scale, zero)
    pairs side by side (words_scale_and_zero)."""
    G, N, _ = scales_and_zeros.shape
    return scales_and_zeros.view(G, N // ROWS, ROWS, 2).transpose(0, 1).contiguous()


def dequantize_words(words: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The rows a block of words stands for, (n, K) fp32, from its scales_and_zeros (n/8, K/g, 8, 2): eager, the
    reference the tests hold dequantize_words_transposed and the products to."""
    m, G = scales_and_zeros.shape[:2]
    return dequantize(unpack_words(words), scales_and_zeros.transpose(0, 1).reshape(G, m * ROWS, 2))


SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble b of a word: bits 4b .. 4b + 3


def dequantize_words_transposed(words: torch.Tensor, scales_and_zeros: torch.Tensor,
                                shifts: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The rows a block of words stands for, transposed: (K, n) fp32, [8j + b, 8m + r] = row 8m + r's weight of
    column 8j + b, from words (n/8, K/8, 8) float32 bits and scales_and_zeros (n/8, K/g, 8, 2); shifts is SHIFTS.
    Laid out as the words are, eight rows side by side, so each vector of the output is one word vector shifted
    (the shift a tensor rather than a Python number: one compiled loop over every nibble position)."""
    m, J, _ = words.shape
    G = scales_and_zeros.shape[1]
    bits = words.view(torch.int32).permute(1, 0, 2).reshape(J, 1, m, ROWS)  # (J, 1, m, 8)
    q = ((bits >> shifts.view(1, 8, 1, 1)) & 15).float().view(G, J // G, 8, m, ROWS)  # (group, word, b, m, r)
    scale, zero = (t.transpose(0, 1).reshape(G, 1, 1, m, ROWS) for t in words_scale_and_zero(scales_and_zeros))
    return ((q - 8) * scale + zero).reshape(J * 8, m * ROWS)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) int32 in [0, 15] -> the layout torch's int4 kernel reads on codes' device."""
    if codes.is_cuda:  # the CUDA packing takes two codes a byte, (N, K/2) uint8, high nibble first
        tiles = next(t for t in INNER_K_TILES if codes.shape[1] % (16 * t) == 0)
        return torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), tiles)
    return torch._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES[-1])  # (N, K/2) uint8


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes of rows packed by `pack` on a CPU, a multiple of PACK_ROWS of them: (n, K/2) uint8 -> (n, K) uint8,
    read in the layout torch's CPU packing writes in this process (cpu_packing)."""
    return UNPACK[cpu_packing()](packed)


def unpack_avx512(packed: torch.Tensor) -> torch.Tensor:
    """torch's CPU packing under AVX-512: in each block of 64 rows, rows s*32 + j (s in {0, 1}, j < 32) keep the
    code of column k in byte [k, j] of the block viewed as (K, 32), the low nibble for s = 0, the high one for s = 1."""
    n, K = len(packed), 2 * packed.shape[1]
    p = packed.view(n // 64, K, 32)  # (n/64, k, j)
    return torch.stack([p & 15, p >> 4], dim=1).transpose(2, 3).reshape(n, K)  # (n/64, s, j, k) -> (n, K)


def unpack_avx2(packed: torch.Tensor) -> torch.Tensor:
    """torch's CPU packing under AVX2: in each block of 64 rows, rows h*32 + s*16 + i (h, s in {0, 1}, i < 16) keep
    the code of column k in byte [h, k, i] of the block viewed as (2, K, 16), the low nibble for s = 0, the high one
    for s = 1."""
    n, K = len(packed), 2 * packed.shape[1]
    p = packed.view(n // 64, 2, K, 16)  # (n/64, h, k, i)
    return torch.stack([p & 15, p >> 4], dim=2).transpose(3, 4).reshape(n, K)  # (n/64, h, s, i, k) -> (n, K)


def unpack_default(packed: torch.Tensor) -> torch.Tensor:
    """torch's CPU packing without vector instructions (its DEFAULT kernels): in each block of 32 rows, rows 2j and
    2j + 1 (j < 16) keep the code of column k in byte [k, j] of the block viewed as (K, 16), the low nibble and the
    high one."""
    n, K = len(packed), 2 * packed.shape[1]
    p = packed.view(n // 32, K, 16)  # (n/32, k, j)
    return torch.stack([p & 15, p >> 4], dim=-1).permute(0, 2, 3, 1).reshape(n, K)  # (n/32, j, s, k) -> (n, K)


UNPACK = {"avx512": unpack_avx512, "avx2": unpack_avx2, "default": unpack_default}


def dequantize_block(packed: torch.Tensor, scales_and_zeros: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows packed by `pack` on a CPU (n, K/2) uint8, in torch's packing `layout` (a key of UNPACK: the layout is a
    constant, so a compiled kernel of this reads it without the probe), and their scales_and_zeros (K/g, n, 2) ->
    the rows they stand for in bf16, (n, K): each weight dequantized in fp32 and rounded to bf16 once."""
    return dequantize(UNPACK[layout](packed), scales_and_zeros).bfloat16()


@functools.cache
def cpu_packing() -> str:
    """The layout torch's CPU int4 packing writes in this process (a key of UNPACK). torch packs differently for each
    instruction set it dispatches to (AVX-512, AVX2, none), so rather than trust a name, this packs known codes once
    and keeps the layout that reads them back (tests/test_widen.py holds each layout to torch's own packing)."""
    codes = torch.randint(0, 16, (PACK_ROWS, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = pack(codes)
    for name, read in UNPACK.items():
        if torch.equal(read(packed), codes.to(torch.uint8)):
            return name
    raise RuntimeError("torch packs int4 weights for this CPU in a layout this version cannot read back; "
                       "QWEN3_SCRATCH_INT4_LAYOUT=words keeps int4 in its own layout")  # fmt: skip

