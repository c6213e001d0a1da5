"""Packaging the kernels a process compiled, ahead of time, for every later start (aot.py says why).

    start_background_build()    # the CLI, after the load: a niced process runs main(SPECS.json) once the CLI exits
                                # (and at its exit, for what it compiled since: int4's blocks of rows)

Each kernel is exported (torch.export) and compiled by AOTInductor into one .pt2 package, then checked
against the inductor kernel of the same function: equal bits on random inputs, or the entry is stored
as unverified and never loaded. Files are written beside their final names and renamed into place,
entry.json last, so a reader sees a whole entry or none.
"""

import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from qwen3_scratch import after_exit

from . import aot

LOG = "build.log"


def start_background_build() -> bool:
    """Hand the kernels this process compiled with inductor since the last call to a niced background builder.
    True if one was started (a line on stderr says so); with nothing new, nothing is started."""
    if not aot.PENDING or not aot.enabled():
        return False
    root = aot.cache_root() / aot.machine_key()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".json", dir=root, delete=False) as specs:
            json.dump(list(aot.PENDING.values()), specs)
        after_exit.start("qwen3_scratch.kernels.aot_build", [specs.name], root / LOG)  # niced, once this process exits
    except OSError:  # a cache folder that cannot be written (a read-only home): every start compiles, as before
        aot.PENDING.clear()
        return False
    print(f"[building {len(aot.PENDING)} CPU kernels ahead of time in the background, paid once per machine, model "
          f"shapes, dtype and torch version; later starts load them without the compiler: {root}]", file=sys.stderr)  # fmt: skip
    aot.PENDING.clear()
    return True


def resolve(name: str):
    module, _, qualname = name.partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def example(shape: list[int], dtype: str | torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random inputs for the bit-for-bit check: normal floats, small integers for integer arguments, any byte
    for bytes (int4's packed codes)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype.is_floating_point:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    low, high = (0, 256) if dtype == torch.uint8 else (-8, 8)
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def examples(shapes: list, dtypes: list, seed: int) -> list[torch.Tensor]:
    """example's inputs for a kernel of any size (a `dynamic` key's "examples"), each argument from its own seed."""
    return [example(shape, dtype, seed * 1000 + i) for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))]


class Kernel(torch.nn.Module):
    def __init__(self, fn, constants: dict):
        super().__init__()
        self.fn, self.constants = fn, constants

    def forward(self, *tensors):
        return self.fn(*tensors, **self.constants)


def build(key: dict) -> bool:
    """Package one kernel into its entry folder; True if it matched the inductor kernel bit for bit."""
    if "dynamic" in key:
        return build_dynamic(key)
    import torch._inductor  # the compiler: only this process pays its import

    from .matvec import inductor_options, jit_kernel

    fn, constants = resolve(key["function"]), key["constants"]
    examples = [example(shape, dtype) for shape, dtype in key["args"]]
    folder = aot.entry_folder(key)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.export.export(Kernel(fn, constants), tuple(examples), strict=False)
        partial = folder / ("partial-" + aot.PACKAGE)  # the packager wants a name ending in .pt2
        options = inductor_options(fn)  # as matvec.kernel's: eager's bf16 roundings, and fn's own
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
        expected = jit_kernel(fn, examples, constants)(*examples)
        outputs = 0 if isinstance(expected, torch.Tensor) else len(expected)
        got = aot.PackagedKernel(partial, outputs)(*examples)
    verified = same_bits(expected, got)
    partial.rename(folder / aot.PACKAGE)
    write_entry(folder, {"key": key, "sha256": aot.file_sha(folder / aot.PACKAGE), "outputs": outputs, "verified": verified})
    return verified


def build_dynamic(key: dict) -> bool:
    """Package a kernel for any size of its named dimensions (aot.kernel_key's `dynamic`): exported at the first
    sizes with those dimensions symbolic, then checked against the compiled kernel it stands in for, bit for bit,
    at every sizes listed."""
    import torch._inductor

    fn, constants, spec = resolve(key["function"]), key["constants"], key["dynamic"]
    make = resolve(spec["examples"])
    if spec["reference"] == aot.ANY_SIZE:  # fn as torch.compile builds it for any size, with these options
        reference = aot.compile_for_any_size(fn, spec["inductor"])
    else:
        reference = resolve(spec["reference"])
    names = sorted({size for shape, _ in key["args"] for size in shape if isinstance(size, str)})
    dims = {name: torch.export.Dim(name, min=1, max=2**31 - 1) for name in names}  # any size an int32 holds
    dtypes = [getattr(torch, dtype) for _, dtype in key["args"]]

    def inputs(sizes: dict, seed: int) -> list:
        shapes = [[sizes[s] if isinstance(s, str) else s for s in shape] for shape, _ in key["args"]]
        return make(shapes, dtypes, seed)

    dynamic_shapes = [{i: dims[s] for i, s in enumerate(shape) if isinstance(s, str)} or None for shape, _ in key["args"]]
    folder = aot.entry_folder(key)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.export.export(Kernel(fn, constants), tuple(inputs(spec["sizes"][0], 0)),
                                      dynamic_shapes=(tuple(dynamic_shapes),), strict=False)  # fmt: skip
        partial = folder / ("partial-" + aot.PACKAGE)
        options = dict(spec["inductor"])  # a copy: the packager adds its own settings to the dict it is given
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
        package, verified, outputs = None, True, 0
        for seed, sizes in enumerate(spec["sizes"]):
            args = inputs(sizes, seed)
            expected = reference(*args, **constants)
            outputs = 0 if isinstance(expected, torch.Tensor) else len(expected)
            package = package or aot.PackagedKernel(partial, outputs)
            got = package(*args)
            verified &= same_bits(expected, got)
    partial.rename(folder / aot.PACKAGE)
    write_entry(folder, {"key": key, "sha256": aot.file_sha(folder / aot.PACKAGE), "outputs": outputs, "verified": verified})
    return verified


def write_entry(folder: Path, entry: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / (aot.ENTRY + ".partial")).write_text(json.dumps(entry, indent=1))
    (folder / (aot.ENTRY + ".partial")).rename(folder / aot.ENTRY)  # whole or absent


def same_bits(expected, got) -> bool:
    """The package's outputs are the compiled kernel's, bit for bit: compared as integers, so a NaN equals the same
    NaN (random examples can hold NaN where a kernel reads floats' bits as something else: int4's bf16 scale pairs,
    Int4Linear.scale_words)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t
    return all(torch.equal(bits(a), bits(b)) for a, b in zip(as_tuple(expected), as_tuple(got), strict=True))


def as_tuple(x):
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def main(argv=None) -> int:
    import fcntl

    specs_file = Path((argv if argv is not None else sys.argv[1:])[0])
    keys = json.loads(specs_file.read_text())
    specs_file.unlink(missing_ok=True)
    with open(aot.cache_root() / aot.machine_key() / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # another builder is at work; what it leaves out, a later start hands over again
        for key in keys:
            if (aot.entry_folder(key) / aot.ENTRY).exists():
                continue
            try:
                print(f"{key['function']} {key['args']}: {'verified' if build(key) else 'UNVERIFIED'}", flush=True)
            except Exception as error:  # stored as unverified: later starts use inductor, without retrying
                print(f"{key['function']} {key['args']}: failed: {type(error).__name__}: {error}", flush=True)
                write_entry(aot.entry_folder(key), {"key": key, "verified": False, "error": str(error)[:500]})
    return 0
