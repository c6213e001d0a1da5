"""int8 weight-only quantization, computed at load time (nothing is written to disk); int4 is in int4.py.

Batch-1 decode reads every weight once per token, so halving the bytes of bf16 (or quartering fp32)
is close to that much faster. Weight-only: activations stay in the model's dtype, only the matrices
are stored as int8 with one scale per output row (per output channel), as gpt-fast does:

    scale[n] = max_k |W[n, k]| / 127        q[n, k] = round(W[n, k] / scale[n])  in [-127, 127]
    y = (x @ q.T) * scale                   == x @ (q * scale[:, None]).T  up to float rounding

Every nn.Linear is quantized (the projections and lm_head; a tied lm_head gets its own int8 copy and
the embedding stays as loaded, since a lookup reads one row). The norms stay in the model's dtype.

Shapes: N out_features, K in_features.
"""

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_scratch.errors import CheckpointError
from qwen3_scratch.model.qwen3 import Qwen3

from . import int4_pairs, widen
from .fuse import replace_linears
from .int4 import DEFAULT_GROUP_SIZE, Int4Linear, check_group_size
from .int4_pairs import Int4PairsLinear
from .matvec import cpu_reads_words, kernel, matvec_int8, matvec_int8_words, one_row, stored_kernel, unavailable_reason

SCHEMES = ("int8", "int4")  # int4: group-wise scales and zero points, int4.py


def quantize_rows(weight: torch.Tensor, rows_per_chunk: int = 4096,
                  words: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(N, K) float -> q (N, K) int8 and scales (N,) fp32, symmetric, one scale per row; with `words`, q's columns
    interleaved (interleave_columns).

    In chunks of rows, so the fp32 temporaries of a 151936-row lm_head never exist all at once. On a CPU each chunk
    runs quantize_rows_chunk's stored kernel once an earlier start has stored it (0.6 s for the 0.6B shapes on an
    AMD EPYC Zen 3, against 1.8-3.4 s eagerly); until then eagerly, the same bits, since building the kernels
    cost a first start more (~11 s) than the eager ops.
    """
    N = len(weight)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)  # (N, K)
    scales = torch.empty(N, dtype=torch.float32, device=weight.device)  # (N,)
    for start in range(0, N, rows_per_chunk):
        # in fp32 (exact for bf16): a loop over bf16 runs 16 lanes wide, and at::vec converts 16 fp32 lanes to
        # integers one lane at a time on AVX2 (3.6x slower)
        w = weight[start : start + rows_per_chunk].float().contiguous()  # (n, K)
        stored = stored_kernel(quantize_rows_chunk, w, words=words)
        if stored is not None:
            codes, s = stored(w)
            codes = codes.view(torch.int8)  # words: (n, K/4) int32 -> their bytes, (n, K)
        else:  # eagerly, the words interleaved afterwards (their ORs run 5x slower eagerly)
            codes, s = quantize_rows_chunk(w, words=False)
            codes = interleave_columns(codes) if words else codes
        q[start : start + rows_per_chunk] = codes
        scales[start : start + rows_per_chunk] = s
    return q, scales


def quantize_rows_chunk(w: torch.Tensor, *, words: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w (n, K) fp32 -> codes and scales (n,), compiled: codes (n, K) int8, or with `words` (n, K/4) int32 words whose
    bytes are interleave_columns' order (little-endian: byte b of word j is column b*K/4 + j), each ORed from the
    four quarters of the row read in order (interleave_columns' transposed copy in the loop ran 5-9x slower; this
    loop takes 0.84 ms for 4096 x 1024, the eager ops 9.4)."""
    s = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # an all-zero row stays zero
    q = torch.round(w / s[:, None]).clamp(-127, 127)  # (n, K)
    if not words:
        return q.to(torch.int8), s
    n, K = w.shape
    quarters = (q.to(torch.int32) & 255).view(n, 4, K // 4)  # each code's byte
    word = quarters[:, 0]
    for b in range(1, 4):
        word = word | (quarters[:, b] << (8 * b))  # byte 3 reaches the sign bit: a bit pattern
    return word, s


def interleave_columns(t: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (..., K), column b*K/4 + j moved to 4j + b: every four consecutive entries (one 32-bit word of
    int8 codes) hold one column from each quarter of the row (matvec.matvec_int8_words). The same reordering of
    an activation row keeps any product with interleaved codes equal to the product in the rows' order."""
    K = t.shape[-1]
    return t.reshape(*t.shape[:-1], 4, K // 4).transpose(-1, -2).reshape(t.shape)


def deinterleave_columns(t: torch.Tensor) -> torch.Tensor:
    """interleave_columns undone: (..., K) in the rows' own column order."""
    K = t.shape[-1]
    return t.reshape(*t.shape[:-1], K // 4, 4).transpose(-1, -2).reshape(t.shape)


def cpu_reads_int8_as_words() -> bool:
    """True on a CPU whose widest vectors are AVX2's (little-endian, as every x86 is), where the one-row int8 loop
    reads its codes four to a word (matvec.matvec_int8_words): 10.7 GB/s of a 3072 x 1024 matrix against 1.2
    for matvec_int8's loop, on the AMD EPYC Zen 3 (docs/performance.md). With AVX-512 inductor's int8 loads are
    masked loads, and matvec_int8 reads at the bandwidth (1.02x llama.cpp's Q8_0 on the Zen 4)."""
    return cpu_reads_words()


# How an int8 product runs (Int8Linear.route). On a GPU the default is "fused-cast"; gpu_check measures both.
#   "cpu"         a CPU: one row through the compiled loop (matvec.py), several through torch's CPU kernel, or
#                 in fp32 from widen.MIN_INT8_ROWS rows on where the CPU has no bf16 instructions (widen.py);
#   "fused-cast"  gpt-fast's expression, F.linear(x, q.to(bf16)) * scales: under torch.compile (with
#                 coordinate-descent tuning, generation/compile_cache.py) the cast fuses into the product's
#                 reduction, so each weight is read as one byte; eagerly it is a bf16 copy of q, then cuBLAS;
#   "int8pack"    torch._weight_int8pack_mm, torch's own int8 kernel on the device (recent torch has a CUDA one);
#   "row-kernel"  a GPU's batch-1 decode (the "decode" layout there, gpu_decode.py): one row through a kernel
#                 inductor builds for the product alone (`int8_row`: the cast inside the reduction, each
#                 weight read as one byte), without compiling the model; other shapes as "fused-cast".
#                 Replayed from a CUDA graph, the eager "fused-cast" was a bf16 copy of every matrix a step
#                 (581 copies, 21 of 28 ms at 8B on an H200).
ROUTES = ("cpu", "fused-cast", "int8pack", "row-kernel")


def int8_row(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (1, K) times int8 weight (N, K) transposed, times the row scales (N,) -> (N,) in x's dtype: summed in
    fp32, then scaled in fp32 and rounded once (a half-precision product also sums in fp32 and rounds once)."""
    return ((weight.float() * x.float()).sum(-1) * scales.float()).to(x.dtype)


int8_row.inductor_config = {"coordinate_descent_tuning": True}  # the reduction's block sizes tuned at its build


class Int8Linear(nn.Module):
    """y = (x @ q.T) * scales, with q int8 (N, K) and scales (N,) in the activations' dtype."""

    scheme = "int8"

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, words: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.split_sizes = getattr(linear, "split_sizes", None)
        cpu = linear.weight.device.type == "cpu"
        # words: the codes' columns interleaved, four to a 32-bit word (where the CPU reads them faster so)
        self.words = (cpu_reads_int8_as_words() if words is None else words) and cpu and self.in_features % 4 == 0
        q, scales = quantize_rows(linear.weight.detach(), words=self.words)
        self.weight = nn.Parameter(q, requires_grad=False)  # (N, K) int8
        self.scales = nn.Parameter(scales.to(dtype), requires_grad=False)  # (N,)
        self.bias = linear.bias
        self.route = "cpu" if cpu else "fused-cast"
        self.kernel = None  # on a CPU where inductor works: the compiled one-row loop (matvec.py)
        if cpu and unavailable_reason() is None:
            self.kernel = kernel(self.row_product, torch.empty(1, self.in_features), self.codes, self.scales)

    @property
    def row_product(self):
        """The one-row loop's function (matvec.py): over the codes as they are laid out."""
        return matvec_int8_words if self.words else matvec_int8

    @property
    def codes(self) -> torch.Tensor:
        """What the one-row loop reads: the int8 codes (N, K), or their words (N, K/4) as float32 bits."""
        return self.weight.view(torch.float32) if self.words else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.route == "row-kernel" and x.numel() == self.in_features and not torch.compiler.is_compiling():
            row = x.reshape(1, self.in_features).contiguous()
            y = kernel(int8_row, row, self.weight, self.scales)(row, self.weight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.route in ("fused-cast", "row-kernel"):  # (row-kernel: more than one row)
            # Why 14 tok/s at 8B on an H100 (10x slower than bf16) with `F.linear(...) * self.scales`:
            # inductor's post-grad pass (torch/_inductor/fx_passes/quantization.py, the "woq" patterns, which
            # accept CUDA in recent torch) rewrites exactly that expression, with bf16 scales, into
            # _weight_int8pack_mm, whose CUDA kernel gives each output to one thread walking its whole row
            # (uncoalesced reads; pytorch/pytorch#190529 rewrites it). The
            # product times the scales in fp32 is the same bits (a bf16 product is computed in fp32 and
            # rounded once) and no longer matches the pattern, so the cast fuses as gpt-fast meant.
            y = F.linear(x, self.weight.to(x.dtype))  # (..., N)
            y = (y.float() * self.scales.float()).to(x.dtype)
        elif self.route == "cpu" and self.kernel is not None and one_row(x, self.in_features):
            product = self.row_product if torch.compiler.is_compiling() else self.kernel  # traced, or compiled here
            y = product(x.reshape(1, self.in_features).float().contiguous(), self.codes, self.scales)  # (N,)
            y = y.view(*x.shape[:-1], self.out_features)
        else:  # several rows on a CPU, or the "int8pack" route: torch's kernel for int8 weights and row scales
            rows = x.reshape(-1, self.in_features)
            rows = interleave_columns(rows) if self.words else rows  # in the codes' column order
            if self.route == "cpu" and widen.widens(rows, self.in_features, widen.MIN_INT8_ROWS):
                y = widen.linear_int8(rows, self.weight, self.scales)  # a prompt without bf16 instructions: in fp32
            else:
                y = torch._weight_int8pack_mm(rows, self.weight, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def use_int8_route(model: nn.Module, route: str) -> None:
    """Run every int8 product of `model` by `route` (ROUTES); scripts/gpu_check.py measures them side by side."""
    if route not in ROUTES:
        raise CheckpointError(f"int8 route {route!r} is not one of {', '.join(ROUTES)}")
    for module in model.modules():
        if isinstance(module, Int8Linear):
            if route != "cpu" and module.words:  # the other routes read the codes in the rows' own order
                module.weight = nn.Parameter(deinterleave_columns(module.weight), requires_grad=False)
                module.words, module.kernel = False, None
            module.route = route


@torch.no_grad()
def quantize_model(model: Qwen3, scheme: str = "int8", group_size: int = DEFAULT_GROUP_SIZE) -> Qwen3:
    """Replace every nn.Linear by an Int8Linear (or an Int4Linear of `group_size`), in place, one matrix at
    a time (never a full copy)."""
    if scheme not in SCHEMES:
        raise CheckpointError(f"--quantize {scheme!r} is not supported; use one of {', '.join(SCHEMES)}")
    dtype = model.model.embed_tokens.weight.dtype
    if scheme == "int8":
        return replace_linears(model, lambda linear: Int8Linear(linear, dtype))
    for name, module in model.named_modules():  # every matrix checked before any is replaced
        if isinstance(module, nn.Linear):
            check_group_size(group_size, module.in_features, name)
    return replace_linears(model, lambda linear: (Int4PairsLinear if int4_pairs.holds(linear, group_size) else
                                                  Int4Linear)(linear, dtype, group_size))  # fmt: skip


def dequantized_weight(layer: Int8Linear) -> torch.Tensor:
    """The float matrix an Int8Linear stands for, (N, K) fp32: the reference its products must equal."""
    codes = deinterleave_columns(layer.weight) if layer.words else layer.weight
    return codes.float() * layer.scales.float()[:, None]
