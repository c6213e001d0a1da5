"""Load time and peak host RAM of our `load_model` against `transformers.from_pretrained`, side by side.

    python scripts/bench/benchmark_load.py                      # Qwen3-0.6B shapes, CPU
    python scripts/bench/benchmark_load.py --device cuda        # time to GPU, peak host RAM on the way
    python scripts/bench/benchmark_load.py --size 8B --json load-8b.json

The checkpoint has the exact shapes of one Qwen3 size with random bf16 weights (written by
scripts/checkpoints/make_shape_checkpoint.py if missing), so no download is needed and the bytes on disk are real.

Peak RSS is a per-process high-water mark, so every load runs in a fresh subprocess that first
imports *both* libraries (so neither pays for, or is charged with, the other's imports), records its
RSS, loads, and records the peak. Only then does it read every page of every weight once, timed (a
loader that leaves tensors mmap'd on disk pays its deferred reads there), and run a checksum and one
forward, to prove the weights are really there. The two loaders alternate, a few times each, after one
untimed read of the files, so both see a warm page cache; the table gives the median.
"""

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for folder in (ROOT, HERE, ROOT / "scripts" / "checkpoints"):  # run as a script from anywhere
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

LOADERS = ("ours", "transformers")
MiB = 2**20


# ---- the measurement, inside one fresh subprocess ----------------------------------------------


def rss_bytes(field: str = "VmRSS") -> int:
    """One line of /proc/self/status: VmRSS (all resident), RssAnon (heap only), RssFile (mapped files)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """The process's high-water resident set (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class AnonPeakSampler:
    """Samples RssAnon every millisecond: the peak of memory the process owns, as opposed to ru_maxrss,
    which also counts pages of mmap'd files (page cache the kernel can drop). Sampling can miss a
    very short spike, so it is a lower bound; ru_maxrss is exact."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes("RssAnon"))
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes("RssAnon"))


def load(loader: str, path: str, device: str):
    """The call being measured; returns (model, a function ids -> logits)."""
    import torch

    if loader == "ours":
        from qwen3_scratch import load_model

        model = load_model(path, device, "bfloat16")
        return model, model
    import transformers

    if device == "cpu":  # the plain call most users make
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    elif importlib.util.find_spec("accelerate"):  # transformers loads straight onto the GPU only through accelerate
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    return model, lambda ids: model(ids).logits


def measure(loader: str, path: str, device: str) -> dict:
    """Load once and report time and memory; run in a fresh process (see run_worker)."""
    # Both workers import both libraries (and transformers' lazily imported Qwen3 module), so the
    # baselines are equal and neither load is charged for an import.
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: F401

    import qwen3_scratch  # noqa: F401

    torch.set_grad_enabled(False)
    if device == "cuda":
        torch.zeros(1, device="cuda")  # create the CUDA context (~hundreds of MB of host RAM) before the baseline
    baseline, baseline_anon = rss_bytes(), rss_bytes("RssAnon")
    with AnonPeakSampler() as anon:
        start = time.perf_counter()
        model, forward = load(loader, path, device)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    # A loader may return tensors that still live on disk (mmap'd, read on first use); reading
    # every page now charges that deferred work to it, so load + touch is the time to a ready model.
    start = time.perf_counter()
    touch_every_page(model)
    touch_seconds = time.perf_counter() - start
    peak_resident = peak_rss_bytes()
    return {
        "loader": loader,
        "load_s": seconds,
        "touch_s": touch_seconds,
        "ready_s": seconds + touch_seconds,
        "baseline_rss": baseline,
        "peak_rss": peak,
        "peak_increase": peak - baseline,
        "anon_peak_increase": anon.peak - baseline_anon,
        "resident_peak_increase": peak_resident - baseline,
        "rss_file_after_touch": rss_bytes("RssFile"),
        **prove_loaded(model, forward, device),
    }


def touch_every_page(model) -> None:
    """Read one element per 4 KiB page of every parameter: cheap, but every byte ends up resident."""
    import torch

    for p in model.parameters():
        flat = p.detach().reshape(-1)  # parameters are contiguous, so this is a view
        stride = max(1, 4096 // p.element_size())
        flat[::stride].sum()
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def prove_loaded(model, forward, device: str) -> dict:
    """A checksum of every parameter (equal for both loaders when they loaded the same weights) and
    one forward on random ids."""
    import torch

    checksum = sum(p.sum(dtype=torch.float32).item() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    logits = forward(ids.to(device))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "checksum": checksum,
        "logits_finite": bool(torch.isfinite(logits.float()).all()),
    }


# ---- the driver ---------------------------------------------------------------------------------


def run_worker(loader: str, path: Path, device: str) -> dict:
    """One measurement in a fresh interpreter; its result comes back as the last line of stdout."""
    command = [sys.executable, __file__, "--worker", loader, "--checkpoint", str(path), "--device", device]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{loader} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm_page_cache(path: Path) -> None:
    """Read every file once, untimed, so the first loader measured is not the only one paying for the disk."""
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            while f.read(64 * MiB):
                pass


def summarise(runs: list[dict], checkpoint_bytes: int) -> dict:
    """Median of each figure over the repeats, and the memory figures as multiples of the checkpoint."""
    keys = ("load_s", "touch_s", "ready_s", "peak_rss", "peak_increase", "anon_peak_increase",
            "resident_peak_increase", "rss_file_after_touch", "baseline_rss")
    summary = {key: statistics.median(run[key] for run in runs) for key in keys}
    summary["load_s_all"] = [round(run["load_s"], 3) for run in runs]
    summary["checksum"], summary["parameters"] = runs[0]["checksum"], runs[0]["parameters"]
    summary["logits_finite"] = all(run["logits_finite"] for run in runs)
    summary["ratio_to_checkpoint"] = summary["peak_increase"] / checkpoint_bytes
    summary["resident_ratio_to_checkpoint"] = summary["resident_peak_increase"] / checkpoint_bytes
    return summary


ROWS = (
    # (label, key, unit divisor, format)
    ("load call (s)", "load_s", 1, ".2f"),
    ("first read of every weight page, after the call (s)", "touch_s", 1, ".3f"),
    ("ready: load + first read (s)", "ready_s", 1, ".2f"),
    ("peak RSS of the process (MiB)", "peak_rss", MiB, ".0f"),
    ("peak RSS increase during the load call (MiB)", "peak_increase", MiB, ".0f"),
    ("… of which anonymous (owned, not file pages; sampled) (MiB)", "anon_peak_increase", MiB, ".0f"),
    ("peak RSS increase once every weight is resident (MiB)", "resident_peak_increase", MiB, ".0f"),
)


def print_table(results: dict, checkpoint_bytes: int, repeats: int) -> None:
    ours, theirs = results["ours"], results["transformers"]
    print(f"\ncheckpoint: {checkpoint_bytes / MiB:.0f} MiB on disk ({checkpoint_bytes:,} bytes); "
          f"median of {repeats} alternating runs each, warm page cache\n")
    print("| | ours (`load_model`) | transformers (`from_pretrained`) | ours / transformers |")
    print("|---|---:|---:|---:|")
    for label, key, scale, fmt in ROWS:
        a, b = ours[key] / scale, theirs[key] / scale
        print(f"| {label} | {a:{fmt}} | {b:{fmt}} | {a / b if b else float('nan'):.2f} |")
    for label, key in (("load-call increase / checkpoint size", "ratio_to_checkpoint"),
                       ("resident increase / checkpoint size", "resident_ratio_to_checkpoint")):
        print(f"| {label} | {ours[key]:.2f} | {theirs[key]:.2f} | |")
    print(f"\nload call per run (s): ours {ours['load_s_all']}, transformers {theirs['load_s_all']}")
    same = ours["checksum"] == theirs["checksum"] and ours["parameters"] == theirs["parameters"]
    finite = ours["logits_finite"] and theirs["logits_finite"]
    print(f"same weights loaded (parameter checksum): {same}; finite logits from one forward: {finite}")
    ram_ok, time_ok = ours["ratio_to_checkpoint"] <= 1.2, ours["load_s"] <= theirs["load_s"]
    print(f"targets: peak RAM <= 1.2x checkpoint: {'met' if ram_ok else 'MISSED'} ({ours['ratio_to_checkpoint']:.2f}x); "
          f"load no slower than transformers: {'met' if time_ok else 'MISSED'} "
          f"({ours['load_s']:.2f} s vs {theirs['load_s']:.2f} s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Load time and peak RAM: load_model vs transformers.from_pretrained.")
    parser.add_argument("--size", default="0.6B", help="Qwen3 shapes to use (default 0.6B)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint folder (default weights/qwen3-<size>-shapes)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the weights go")
    parser.add_argument("--repeats", type=int, default=5, help="loads per loader, alternating (default 5)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    parser.add_argument("--worker", choices=LOADERS, help=argparse.SUPPRESS)  # internal: one measurement
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.checkpoint, args.device)))
        return

    from machine import machine, machine_line  # here: a worker (this file run again) imports only what it measures
    from make_shape_checkpoint import default_out, make_shape_checkpoint

    path = Path(args.checkpoint) if args.checkpoint else default_out(args.size)
    if not (path / "config.json").exists():
        print(f"writing a random Qwen3-{args.size}-shaped checkpoint to {path}", flush=True)
        make_shape_checkpoint(args.size, path)
    checkpoint_bytes = sum(file.stat().st_size for file in path.glob("*.safetensors"))
    info = {**machine(args.device), "python": platform.python_version()}
    if args.device == "cuda":
        info["transformers_to_gpu"] = (
            "device_map (accelerate)" if importlib.util.find_spec("accelerate") else "CPU load, then .to(cuda)"
        )
    print(machine_line(info))
    warm_page_cache(path)
    runs = {loader: [] for loader in LOADERS}
    for repeat in range(args.repeats):
        for loader in LOADERS:
            runs[loader].append(run_worker(loader, path, args.device))
            print(f"run {repeat + 1}/{args.repeats} {loader}: {runs[loader][-1]['load_s']:.2f} s", flush=True)
    results = {loader: summarise(runs[loader], checkpoint_bytes) for loader in LOADERS}
    print_table(results, checkpoint_bytes, args.repeats)
    if args.json:
        report = {"machine": info, "checkpoint": str(path), "checkpoint_bytes": checkpoint_bytes,
                  "device": args.device, "size": args.size, "summary": results, "runs": runs}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
