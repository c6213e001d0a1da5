"""The trained fixture's store: a checkpoint kept with everything its training read, taken again only while all of
that is unchanged.

The fixture's 1,000 steps are ~14 minutes of a core, half of the suite's work on a 2-core CPU, and they give the same
weights bit for bit from the same inputs (one seed, one thread, and the switch to two threads moves no bit:
tests/test_trained_fixture.py). So the training process records what it read, and a later session whose training
would read exactly that on this machine takes the stored checkpoint instead of training again:

  - every file it opened under the repository (by its path there: any checkout of the same files matches) or the
    standard library (the corpus reads its sources; an audit hook sees every open, imports included), each by its
    SHA-256;
  - the version of each installed distribution it imported (torch, tokenizers, numpy, ...) and Python's;
  - the CPU (model name and flags: oneDNN and MKL pick their kernels, so their rounding, by it), the machine, and
    the environment variables that steer those libraries.

A change to any of them (the recipe in tests/trained_fixture.py, scripts/tiny/, the model's code, torch) trains
again, as a new machine does; a stored checkpoint whose files no longer hash as written is deleted, never read.

    ~/.cache/qwen3-scratch/trained-fixture/<inputs' hash>/{inputs.json, checkpoint/}   ($QWEN3_SCRATCH_CACHE moves it)

QWEN3_SCRATCH_TRAIN_FIXTURE=1 trains whatever is stored (and stores the result).
"""

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
INSTALLED = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}  # by their versions
METADATA = {".egg-info", ".dist-info"}  # an install's records (an editable install's lie in the repository)
KEPT = 4  # entries kept, newest first: a few branches' fixtures, ~10 MB each
STEERING = ("ATEN_", "ONEDNN_", "DNNL_", "MKL_", "OPENBLAS_")  # environment variables that pick CPU kernels


def folder() -> Path:
    return Path(os.environ.get("QWEN3_SCRATCH_CACHE") or Path.home() / ".cache" / "qwen3-scratch") / "trained-fixture"


def enabled() -> bool:
    return os.environ.get("QWEN3_SCRATCH_TRAIN_FIXTURE", "0") != "1"


def record_opens() -> set[str]:
    """From now on, every file this process opens (its absolute path) lands in the returned set."""
    opened: set[str] = set()

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)):
            opened.add(os.path.abspath(os.fsdecode(args[0])))

    sys.addaudithook(hook)
    return opened


def source_of(path: Path) -> Path:
    """A module's bytecode stands for its source: the source is what a change edits."""
    if path.suffix == ".pyc" and path.parent.name == "__pycache__":
        return path.parent.parent / (path.name.split(".")[0] + ".py")
    return path


def inputs(opened: set[str], out: Path) -> dict:
    """What a training that opened `opened` (and wrote `out`) read: files, distributions, Python, the CPU."""
    out = out.resolve()
    paths = {Path(p) for p in opened} | {Path(m.__file__) for m in list(sys.modules.values())
                                         if getattr(m, "__file__", None)}  # fmt: skip
    files = set()
    for path in paths:
        path = source_of(path.resolve())
        read = path.is_relative_to(ROOT) or path.is_relative_to(STDLIB)
        installed = any(path.is_relative_to(folder) for folder in INSTALLED) or path.parent.suffix in METADATA
        if read and not installed and path.is_file() and not path.is_relative_to(out):
            files.add(path)
    top = {name.partition(".")[0] for name in list(sys.modules)}
    owners = metadata.packages_distributions()
    dists = sorted({dist for name in top for dist in owners.get(name, ())})
    return {"files": {named(path): digest(path) for path in sorted(files)},
            "distributions": {dist: version(dist) for dist in dists},
            "machine": machine()}  # fmt: skip


def machine() -> dict:
    cpu = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))
    except OSError:
        pass
    import platform

    return {"python": sys.version, "platform": platform.platform(), "cpu": cpu,
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(STEERING)}}  # fmt: skip


def named(path: Path) -> str:
    """A repository's file by its path in the repository (any checkout of the same files reads the same), any
    other by its absolute path."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def outputs(checkpoint: Path) -> dict[str, str]:
    return {p.name: digest(p) for p in sorted(checkpoint.iterdir()) if p.is_file()}


def store(checkpoint: Path, read: dict, into: Path | None = None) -> Path:
    """Keep a copy of checkpoint under what its training read; returns the entry (written whole, then renamed)."""
    into = into or folder()
    into.mkdir(parents=True, exist_ok=True)
    record = {**read, "outputs": outputs(checkpoint)}
    text = json.dumps(record, indent=1, sort_keys=True)
    entry = into / hashlib.sha256(json.dumps(read, sort_keys=True).encode()).hexdigest()[:16]
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=into))
    shutil.copytree(checkpoint, staging / "checkpoint")
    (staging / "inputs.json").write_text(text)
    try:
        staging.rename(entry)
    except OSError:  # another session stored the same inputs first: theirs is as good
        shutil.rmtree(staging, ignore_errors=True)
    for old in sorted(entries(into), key=lambda e: e.stat().st_mtime, reverse=True)[KEPT:]:
        shutil.rmtree(old, ignore_errors=True)
    return entry


def entries(into: Path) -> list[Path]:
    return [e for e in into.iterdir() if e.is_dir() and not e.name.startswith(".")] if into.is_dir() else []


def find(into: Path | None = None) -> Path | None:
    """The stored checkpoint whose training read exactly what a training now would, or None."""
    now = machine()
    for entry in entries(into or folder()):
        try:
            record = json.loads((entry / "inputs.json").read_text())
        except (OSError, ValueError):
            continue
        if record.get("machine") != now:
            continue
        if any(version(dist) != v for dist, v in record.get("distributions", {}).items()):
            continue
        if any(digest(ROOT / path) != h for path, h in record.get("files", {}).items()):  # an absolute path stays so
            continue
        checkpoint = entry / "checkpoint"
        if not checkpoint.is_dir() or outputs(checkpoint) != record.get("outputs"):
            shutil.rmtree(entry, ignore_errors=True)  # changed since it was stored: never read
            continue
        os.utime(entry, (time.time(), time.time()))  # the newest kept
        return checkpoint
    return None
