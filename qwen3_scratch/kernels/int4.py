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
packed nibbles unpacked a block at a time (widen.py): 1.2-1.3x faster at 300 rows on an AMD EPYC Zen 3.

Exactness: the kernel dequantizes each weight to the activations' dtype and sums in fp32, so with fp32
activations its logits equal the model whose matrices are `dequantize(...)` to 1e-5 relative
(tests/test_int4.py); with bf16 activations they differ from that by bf16 rounding.

Shapes: N out_features, K in_features, g group_size.
"""

import torch
from torch import nn

from qwen3_scratch.errors import CheckpointError

from . import widen
from .matvec import kernel, unavailable_reason

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
# torch's packing parameter for the CUDA kernel (tinygemm: 2, 4 or 8 tiles of 16 along K per inner step); 8,
# as gpt-fast packs, reads the longest runs per load, and needs K to be a multiple of 128 (every Qwen3 matrix
# is), else 2 (a multiple of 32). The CPU packing ignores it.
INNER_K_TILES = (8, 2)
PACK_ROWS = 64  # torch's CPU packing lays rows out in blocks of 64 (see unpack)


def quantize_groups(weight: torch.Tensor, group_size: int, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> codes (N, K) int32 in [0, 15] and scales_and_zeros (K/g, N, 2) fp32 (tests, references)."""
    chunks = [quantize_chunk(weight[i : i + rows_per_chunk], group_size=group_size) for i in range(0, len(weight), rows_per_chunk)]
    return torch.cat([q for q, _ in chunks]), torch.cat([sz for _, sz in chunks], dim=1)


def quantize_and_pack(weight: torch.Tensor, group_size: int, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> packed codes for torch's kernel and scales_and_zeros (K/g, N, 2) fp32.

    In chunks of rows (a multiple of torch's 64-row packing blocks, so packing chunk by chunk equals packing
    the whole), each one compiled loop on a CPU (matvec.kernel; eager ops took ~30 s for the 0.6B shapes),
    so no int32 or fp32 temporary of a 151936-row lm_head ever exists whole.
    """
    packed, scales_and_zeros = [], []
    for start in range(0, len(weight), rows_per_chunk):
        w = weight[start : start + rows_per_chunk]  # (n, K)
        fn = kernel(quantize_chunk, w, group_size=group_size) if w.device.type == "cpu" and compiler_works() else None
        q, sz = fn(w.contiguous()) if fn else quantize_chunk(w, group_size=group_size)
        packed.append(pack(q))
        scales_and_zeros.append(sz)
    return torch.cat(packed), torch.cat(scales_and_zeros, dim=1)


def quantize_chunk(w: torch.Tensor, *, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (n, K) -> codes (n, K) int32 and scales_and_zeros (K/g, n, 2) fp32, as the module docstring says."""
    n, K = w.shape
    groups = w.float().view(n, K // group_size, group_size)  # (n, K/g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)  # (n, K/g)
    scale = ((hi - lo) / 15).clamp(min=1e-12)  # a constant group keeps a tiny scale, not a division by 0
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)  # (n, K/g, g)
    return q.view(n, K).to(torch.int32), torch.stack([scale.t(), (lo + 8 * scale).t()], dim=-1)  # (K/g, n, 2)


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
    """y = x @ dequantize(codes, scales_and_zeros).T, with the codes packed two to a byte for torch's kernel."""

    scheme = "int4"  # what the stats line calls these weights (their tensor is packed bytes: uint8)

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, group_size: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.split_sizes = getattr(linear, "split_sizes", None)
        packed, scales_and_zeros = quantize_and_pack(linear.weight.detach(), group_size)
        self.weight = nn.Parameter(packed, requires_grad=False)  # opaque layout, K/2 bytes a row
        self.scales_and_zeros = nn.Parameter(scales_and_zeros.to(dtype), requires_grad=False)  # (K/g, N, 2)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B*T, K); the kernels read rows densely, and a view such as forward's last_only slice x[:, -1:] is not
        rows = x.reshape(-1, self.in_features).contiguous()
        if x.is_cuda:
            y = torch._weight_int4pack_mm(rows, self.weight, self.group_size, self.scales_and_zeros)
        elif not self.out_features % PACK_ROWS and widen.widens(rows, self.in_features, widen.MIN_INT4_ROWS):
            y = widen.products(rows, self.out_features, self.widened_block).to(rows.dtype)  # fp32, rounded once
        else:
            y = torch._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scales_and_zeros)
        y = y.view(*x.shape[:-1], self.out_features)  # (..., N)
        return y if self.bias is None else y + self.bias

    def widened_block(self, block: torch.Tensor, start: int, end: int) -> None:
        """Rows start:end of the matrix, dequantized in fp32 into block (widen.products' fill): a prompt on a CPU
        without bf16 instructions. torch's kernel rounds each dequantized weight to the rows' dtype; these stay
        fp32, so the product is nearer the exact one."""
        block.copy_(dequantize(unpack(self.weight[start:end]), self.scales_and_zeros[:, start:end]))


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) int32 in [0, 15] -> the layout torch's int4 kernel reads on codes' device."""
    if codes.is_cuda:  # the CUDA packing takes two codes a byte, (N, K/2) uint8, high nibble first
        tiles = next(t for t in INNER_K_TILES if codes.shape[1] % (16 * t) == 0)
        return torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), tiles)
    return torch._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES[-1])  # (N, K/2) uint8


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes of rows packed by `pack` on a CPU, a multiple of PACK_ROWS of them: (n, K/2) uint8 -> (n, K) uint8.

    torch's CPU packing (torch 2.x, pinned by tests/test_widen.py): in each block of 64 rows, rows h*32 + s*16 + i
    (h, s in {0, 1}, i < 16) keep the code of column k in byte [h, k, i] of the block viewed as (2, K, 16), the low
    nibble for s = 0, the high one for s = 1."""
    n, K = len(packed), 2 * packed.shape[1]
    p = packed.view(n // PACK_ROWS, 2, K, 16)  # (n/64, h, k, i)
    return torch.stack([p & 15, p >> 4], dim=2).transpose(3, 4).reshape(n, K)  # (n/64, h, s, i, k) -> (n, K)

