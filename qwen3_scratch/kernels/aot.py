"""The compiled CPU kernels, built once per machine and kept on disk, loaded later without the compiler.

Every kernel the decode layout compiles (matvec.kernel: the one-row products, the ops between them,
int4's quantizer) is a small graph handed to inductor. Inductor's own on-disk cache spares a later
process the code generation but not inductor itself: its import, its probe of the CPU's vector
instructions (compiler runs) and the loading of each kernel took ~4.5 s of a ~7 s second start of
`qwen3-generate` (0.6B shapes, bf16, Intel Xeon with AMX, 2 cores; docs/performance.md, "Cold start,
issue 30"). Here each kernel is also packaged by AOTInductor (`aoti_compile_and_package`): a .pt2 file
holding a shared library, loaded by torch's C++ loader (`torch._C._aoti`) in ~3 ms, with no inductor,
dynamo or sympy imported.

    ~/.cache/qwen3-scratch/aot/<machine>/<kernel>/kernel.pt2, entry.json     ($QWEN3_SCRATCH_CACHE moves it)

<machine> hashes torch's version, the CPU's model name and flags; <kernel> hashes the function's name,
the source of the model and kernels layers, the argument shapes and dtypes and the constants: a new
torch, CPU, model shape, dtype or code is a new entry, never an old one reused.

The build costs ~20 s for the first package and ~6 s for each further one (11 kernels at the 0.6B
shapes: ~150 s), more than the inductor path it replaces, so the first start runs the inductor kernels
as before and hands the kernels it used to a background builder (aot_build.py: niced, it starts when
the command exits), once; a line on stderr says so. A package is kept
only if its outputs equal the inductor kernel's bit for bit on random inputs (both come from the same
generated code); otherwise the entry says "unverified" and every later start uses inductor. So the
tokens never depend on which way a kernel was obtained, or on when the build finished.

A kernel may also be stored for any size of some of its dimensions (`kernel_key`'s `dynamic`: one package
exported with those sizes symbolic, checked at several): the engine's in-place paged attention, whose rows, table
width and pool change with every step (engine/paged_attention.py), and the ops between a CPU engine layer's
products, for any number of tokens (gpu_decode.py).

An entry is trusted only whole: entry.json must name this exact key and the package's sha256. Anything
else (a torn write, a foreign or corrupt file, a package the loader refuses) is deleted and the kernel
comes from inductor, so a bad cache costs time, never a wrong answer (tests/test_aot_kernels.py).
"""

import functools
import hashlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from qwen3_scratch.files import CACHE_ENV, cache_home  # noqa: F401  (CACHE_ENV: the tests move the cache with it)

FORMAT = 1  # bumped when entry.json or the package layout changes
PACKAGE, ENTRY = "kernel.pt2", "entry.json"

# What every kernel here is compiled with, by this process and by the builder alike, so both give the same bits:
# - emulate_precision_casts: each explicit cast to bf16 rounds where eager rounds it;
# - cpp.vec_isa_ok: inductor compiles for the vector instructions torch's own CPU detection reports (avx512,
#   avx2, ...) without first compiling and loading a test program for each, which cost ~7 s of a first start ever
#   (0.6B shapes, bf16, AMD EPYC: 20.1 -> 14.1 s; docs/performance.md) and a probe process per instruction set
#   on every start that compiles.
#   The instruction set picked is the one the probes pick where they pass (AMX and avx512_bf16 are still probed).
#   A compiler too old for it fails every build, and every kernel then falls back to torch's ops (warned).
#   A user's own TORCHINDUCTOR_VEC_ISA_OK (0: no vector instructions; 1) is left to decide, here and in the builder.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
if "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ:
    INDUCTOR_OPTIONS["cpp.vec_isa_ok"] = True


def failure(error: Exception) -> str:
    """A failed build in one line, for the warning that says which fast path is off and why: the error's type and the
    first line of its message (a compiler's errors run to pages)."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"


def enabled() -> bool:
    """QWEN3_SCRATCH_AOT=0 turns stored kernels off (neither loaded nor built): the test suite's setting."""
    return os.environ.get("QWEN3_SCRATCH_AOT", "1") != "0"


def cache_root() -> Path:
    return cache_home() / "aot"


@functools.cache
def machine_key() -> str:
    """torch's version and the CPU (model name and flags): what a compiled kernel is only valid for."""
    cpu = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "|".join(line for line in lines if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        cpu = platform.processor()
    return sha(f"{torch.__version__}|{platform.machine()}|{cpu}")[:16]


@functools.cache
def code_version() -> str:
    """The source of the layers a kernel's graph is traced from (model/ and kernels/)."""
    package = Path(__file__).resolve().parents[1]
    files = sorted([*package.glob("model/*.py"), *package.glob("kernels/*.py")])
    return sha("".join(f.name + f.read_text() for f in files))[:16]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


ANY_SIZE = "torch.compile for any size, 1 included"  # a dynamic key's "reference": compile_for_any_size


def compile_for_any_size(fn, options: dict):
    """fn compiled by torch.compile with dynamic shapes, one kernel for every size of them, 1 included.

    By default dynamo specialises a size of 1, and inductor's kernel for one row may sum that row in another
    order (its reduction split between the threads) than the kernel for any rows, which is what a package
    exported with symbolic sizes runs: in fp32 their bits differed for one token, so the CPU engine's fp32 norm
    was never stored and every fp32 server start compiled its glue again (~7 s on an AMD EPYC Zen 3;
    docs/performance.md). With sizes treated obliviously (torch.fx's `backed_size_oblivious`, set while each call
    runs, ~6 us: a recompile may happen at any call) the compiled kernel is the package's, at every size."""
    import torch
    from torch.fx.experimental import _config as fx_config

    compiled = torch.compile(fn, dynamic=True, fullgraph=True, options=dict(options))

    def call(*args, **constants):
        before, fx_config.backed_size_oblivious = fx_config.backed_size_oblivious, True
        try:
            return compiled(*args, **constants)
        finally:
            fx_config.backed_size_oblivious = before

    return call


def kernel_key(fn, args, constants: dict, dynamic: dict | None = None) -> dict:
    """Everything a kernel's code depends on, as JSON (also what the builder needs to rebuild it).

    dynamic: a kernel for any size of some dimensions (one package with dynamic shapes; aot_build.build_dynamic):
    {"shapes": each argument's shape with a name ("B") in place of each such size, "examples", "reference":
    "module:function" names of what makes inputs from sizes and of the compiled kernel the package must equal
    (ANY_SIZE: fn compiled for any size with the options below, by `compile_for_any_size`),
    "sizes": the sizes it is exported at (the first) and checked at (all), "inductor": its inductor options}.
    The arguments' own sizes then do not enter the key, only their dtypes."""
    shapes = dynamic["shapes"] if dynamic else [list(a.shape) for a in args]
    key = {
        "format": FORMAT,
        "function": f"{fn.__module__}:{fn.__qualname__}",
        "args": [[shape, str(a.dtype).removeprefix("torch.")] for shape, a in zip(shapes, args, strict=True)],
        "constants": {name: constants[name] for name in sorted(constants)},
        "code": code_version(),
        "machine": machine_key(),
        "torch": torch.__version__,
        "options": dict(INDUCTOR_OPTIONS),  # a user's TORCHINDUCTOR_VEC_ISA_OK gives kernels of its own
    }
    if dynamic:
        key["dynamic"] = {name: value for name, value in dynamic.items() if name != "shapes"}
        key["code"] += module_version(fn)  # such a kernel may live outside model/ and kernels/
    return key


def module_version(fn) -> str:
    """The source of the module fn is defined in."""
    return sha(Path(sys.modules[fn.__module__].__file__).read_text())[:16]


def entry_folder(key: dict) -> Path:
    return cache_root() / key["machine"] / sha(json.dumps(key, sort_keys=True))[:24]


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class PackagedKernel:
    """An AOTInductor package called like inductor's compiled kernel: tensors in, a tensor or a tuple out."""

    def __init__(self, path: Path, outputs: int):
        self.runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1).run
        self.outputs = outputs  # 0: the function returns one tensor, not a tuple

    def __call__(self, *args):
        results = self.runner(list(args))
        return results[0] if self.outputs == 0 else tuple(results)


def load(fn, args, constants: dict, dynamic: dict | None = None):
    """The stored kernel for fn on these arguments, or None (none stored, unverified, or not trusted)."""
    if not enabled():
        return None
    key = kernel_key(fn, args, constants, dynamic)
    folder = entry_folder(key)
    try:
        entry = json.loads((folder / ENTRY).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return discard(folder)
    if entry.get("key") != key:
        return discard(folder)  # a foreign entry (a hash collision, a hand-copied folder): never trusted
    if not entry.get("verified"):
        return None  # the build gave other bits than inductor's kernel: inductor it is, every time
    try:
        if file_sha(folder / PACKAGE) != entry["sha256"]:
            return discard(folder)
        return PackagedKernel(folder / PACKAGE, entry["outputs"])
    except Exception:  # the loader refused the library: rebuilt next time, never half-used
        return discard(folder)


def discard(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    return None


PENDING: dict[str, dict] = {}  # kernels this process compiled with inductor, by entry folder: built later


def remember(fn, args, constants: dict, dynamic: dict | None = None) -> None:
    if not enabled():
        return
    key = kernel_key(fn, args, constants, dynamic)
    PENDING[str(entry_folder(key))] = key


def load_or_remember(fn, args, constants: dict, dynamic: dict | None = None):
    """The stored kernel (load), or None, and then the kernel is handed to the builder at the command's exit: the
    caller compiles it meanwhile."""
    stored = load(fn, args, constants, dynamic)
    if stored is None:
        remember(fn, args, constants, dynamic)
    return stored
