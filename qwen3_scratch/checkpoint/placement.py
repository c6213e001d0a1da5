"""Which model, where it runs and in which dtype, when the user does not say: one rule for every
command and both Python APIs.

`pick_device("auto")` is cuda when a GPU is there, else cpu. `pick_dtype("auto", device, quantize, layout)` is
bfloat16, the dtype Qwen3's checkpoints are published in:

- on a GPU, and on a CPU that multiplies bf16 natively (avx512_bf16 or AMX): decode reads half the bytes of fp32
  and was measured faster (docs/performance.md);
- with int8 or int4 weights, on any CPU: every product is then torch's int8 or int4 kernel, whose CPU code is fast
  with bf16 rows and slow with fp32 ones (on an AMD EPYC Zen 3, AVX2 only: 6.6 against 1.2 GB/s of int8 weights,
  5.2 against 0.4 of int4; a 0.6B int4 decode 12.3 against 1.2 tok/s);
- in the one-row layout ("decode": `qwen3-generate`, `qwen3-chat`, `Pipeline`, and an engine serving one or two
  requests at a time) on any CPU: its compiled loops widen bf16 as they read it, and the prompts' products of
  several rows run in fp32 anyway (kernels/widen.py). On the Zen 3, 0.6B shapes: decode 9.6 against 6.2 tok/s,
  the load 0.25 against 1.6 s (no fp32 copy of the checkpoint), half the memory, prompts about level.

and float32 in one case: the batch layout (an engine serving many requests, `qwen3-serve` and `LLM` by default) on
a CPU without bf16 instructions, where oneDNN's packed fp32 products beat widening bf16 on every step (the Zen 3,
16 requests of 256 tokens and 32 out: 55.3 against 65.7 s).

`qwen3-generate`, `qwen3-chat`, `qwen3-serve`, `Pipeline` and `LLM` all ask these two functions, and every `--help`
says the rule in the words of DTYPE_HELP.

The names and the help text are plain strings, so a command can check `--dtype` and print `--help`
before torch is imported (seconds); the functions import it when they run.
"""

from qwen3_scratch.errors import GenerationError, InputError

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # what `--model` and `Pipeline.load()` mean when not told

# --dtype accepts torch's names and the short ones people type
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DTYPE_NAMES = ["auto", "bfloat16", "float16", "float32", *DTYPE_ALIASES]
DTYPE_HELP = ("auto: bfloat16, except float32 for an engine serving many requests on a CPU without native bf16 "
              "(avx512_bf16 or AMX) and without --quantize; also bf16, fp16/half, fp32/float")  # fmt: skip
DEVICE_HELP = "auto: cuda when a GPU is there, else cpu"


def canonical_dtype(name: str, label: str = "--dtype") -> str:
    """"auto" or torch's name for a dtype, from any name in DTYPE_NAMES."""
    if name not in DTYPE_NAMES:
        raise InputError(f"{label} must be one of {', '.join(DTYPE_NAMES)}; got {name!r}")
    return DTYPE_ALIASES.get(name, name)


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise GenerationError("--device cuda: no CUDA GPU is available; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise GenerationError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def pick_dtype(dtype: str, device: str, quantize: str | None = None, layout: str = "decode") -> str:
    """torch's name for `dtype` (aliases accepted); "auto" by the rule in the module docstring (`quantize`: the
    weights' scheme, "int8" or "int4", or None; `layout`: kernels/layout.py's "decode" or "batch")."""
    dtype = canonical_dtype(dtype)
    if dtype == "auto":
        if device == "cuda" or quantize is not None or layout == "decode":
            return "bfloat16"
        from qwen3_scratch.kernels.widen import cpu_has_native_bf16  # imports torch: only when asked

        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return dtype
