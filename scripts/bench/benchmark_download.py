"""What checking downloads costs: our transfer (hashing as it writes) against huggingface_hub's snapshot_download,
and `--verify` (hashing a folder on disk again), with peak RAM, on the fake Hub on 127.0.0.1.

    python scripts/bench/benchmark_download.py                 # a 512 MiB shard, 3 runs each
    python scripts/bench/benchmark_download.py --mib 2048 --runs 1

The repo is a config.json and one random-bytes `model.safetensors` of --mib MiB, served by tests/fake_hub.py
(a plain-Python HTTP server, so absolute speeds are the server's as much as the client's: compare the two
clients with each other, not with a real network). Each download runs in a fresh subprocess into an empty
folder, so its peak RSS (VmHWM) is its own; the table gives the medians.
"""

import argparse
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT, ROOT / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from fake_hub import serve_fake_hub  # noqa: E402
from machine import Table, machine, machine_line  # noqa: E402

REPO = "bench-org/one-shard"
MiB = 2**20

CLIENT = r"""
import json, sys, time
from pathlib import Path
from huggingface_hub import snapshot_download
from qwen3_scratch.checkpoint.hub import resolve_checkpoint
which, endpoint, out = sys.argv[1:]
start = time.perf_counter()
if which == "ours":
    resolve_checkpoint("REPO", out, endpoint=endpoint, progress=False)
elif which == "verify":
    resolve_checkpoint("REPO", out, endpoint=endpoint, progress=False, verify=True)
else:
    snapshot_download("REPO", local_dir=Path(out) / "one-shard", endpoint=endpoint, tqdm_class=None)
seconds = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent (which serves the file) across exec.
peak_kib = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(json.dumps({"seconds": seconds, "peak_rss_mib": peak_kib / 1024}))
""".replace("REPO", REPO)


def write_repo(folder: Path, mib: int) -> None:
    """config.json and a valid one-tensor safetensors file of random bytes."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    nbytes = mib * MiB
    header = json.dumps({"w": {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]}}).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for _ in range(mib):
            f.write(os.urandom(MiB))


def run_client(which: str, endpoint: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-c", CLIENT, which, endpoint, str(out)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{which} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="size of the shard in MiB (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each client (default %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_repo(tmp / "repo", args.mib)
        results = {"ours": [], "snapshot_download": [], "verify": []}
        with serve_fake_hub({REPO: tmp / "repo"}) as hub:
            for run in range(args.runs):
                for which in ("ours", "snapshot_download"):
                    out = tmp / f"{which}-{run}"
                    results[which].append(run_client(which, hub.url, out))
                    if which == "ours":  # the folder is complete: --verify hashes it again, fetches nothing
                        results["verify"].append(run_client("verify", hub.url, out))
    print(machine_line({**machine(), "python": platform.python_version()}))
    print(f"{args.mib} MiB shard, fake Hub on 127.0.0.1")
    table = Table("client", "seconds (median)", "MiB/s", "peak RSS MiB")
    for which, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        rss = statistics.median(r["peak_rss_mib"] for r in runs)
        table.row(which, f"{seconds:.2f}", f"{args.mib / seconds:.0f}", f"{rss:.0f}")


if __name__ == "__main__":
    main()
