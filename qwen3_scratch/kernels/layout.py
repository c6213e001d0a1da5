"""The layout a loaded model runs in: which of this layer's kernels replace the checkpoint's plain layers.

`checkpoint.load_model(optimize=..., quantize=...)` loads the checkpoint strictly into the plain model
(model/), then hands it here. Nothing here changes what the model computes beyond float rounding, and
nothing touches the checkpoint's keys: every transform swaps modules in memory, one layer at a time.

  None      the checkpoint's own layout, as model/ wrote it: the parity suite's reference;
  "decode"  one sequence at a time (the CLI, chat, Pipeline): on a CPU, one-row products run compiled
            loops over the checkpoint's own matrices (matvec.py), which read weights near the memory
            bandwidth and copy nothing, and the ops between them run as a few kernels a layer
            (cpu_decode.py); a model that speculates gets packed copies for its few-row products
            (fewrow.py, called by generation/speculative.py);
  "batch"   several rows per step (the engine, serving): q/k/v and gate/up fused into one matrix each
            and every matrix prepacked for oneDNN (fuse.py), whose kernels are fastest once a step has
            many rows (in bf16 on a CPU without bf16 instructions, where oneDNN packs none or emulates bf16,
            products of many rows run in fp32 over the same matrices instead: widen.py).
Off the CPU, or where inductor cannot build kernels, "decode" falls back to "batch"; on a GPU "decode" then
also runs the ops between the products as four compiled kernels a layer (gpu_decode.py), which is what a
decode step replayed from a CUDA graph is made of; "batch" there does the same for every step, by kernels
compiled for any number of tokens, and on a CPU by the same kernels once they are stored (aot.py).
`quantize="int8"` stores every matrix as int8 with per-row scales (quantize.py), `quantize="int4"` as int4
with a scale and zero point per group of `group_size` weights (int4.py), in either layout.
"""

from qwen3_scratch.model.qwen3 import Qwen3

from .cpu_decode import use_cpu_decoder_layers
from .fuse import fuse_projections, prepack_for_cpu
from .gpu_decode import use_gpu_decoder_layers
from .int4 import DEFAULT_GROUP_SIZE, GROUP_SIZES
from .matvec import can_use_matvec, use_matvec
from .quantize import SCHEMES, quantize_model, use_int8_route
from .widen import use_widened

LAYOUTS = (None, "decode", "batch")
__all__ = ["DEFAULT_GROUP_SIZE", "GROUP_SIZES", "LAYOUTS", "SCHEMES", "optimize_layout"]


def optimize_layout(model: Qwen3, optimize: str | None, quantize: str | None,
                    group_size: int = DEFAULT_GROUP_SIZE) -> Qwen3:  # fmt: skip
    """Lay `model` out for `optimize` (see the module docstring) and quantize it, in place."""
    cpu_decode = optimize == "decode" and can_use_matvec(model)
    if cpu_decode and quantize is None:
        use_matvec(model)
    else:
        if optimize:
            fuse_projections(model)
        if quantize is not None:
            quantize_model(model, quantize, group_size)  # its one-row products on a CPU are compiled loops too
        if optimize:
            # first: on a CPU without bf16 instructions a bf16 model's products of many rows run in fp32 (widen.py),
            # even where oneDNN would pack bf16 and emulate it (AVX-512 without avx512_bf16)
            use_widened(model)
            prepack_for_cpu(model)  # what is still an nn.Linear; no-op off the CPU; int8 layers have their own layout
    if cpu_decode:
        use_cpu_decoder_layers(model)  # and the ops between the products, a few compiled kernels a layer
    elif optimize == "decode" and model.device.type == "cuda":
        if quantize == "int8":  # each one-row int8 product one compiled kernel, the cast inside it
            use_int8_route(model, "row-kernel")
        # the same on a GPU, around cuBLAS's products; where inductor cannot build kernels, all as it was
        if not use_gpu_decoder_layers(model) and quantize == "int8":
            use_int8_route(model, "fused-cast")
    elif optimize == "batch":
        # the engine's steps, any number of tokens packed: on a GPU compiled kernels, on a CPU stored ones
        use_gpu_decoder_layers(model, any_length=True)
    return model
