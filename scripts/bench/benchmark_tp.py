"""Tensor parallelism on one CPU: decode speed and per-rank peak memory, TP=N against TP=1, side by side.

    python scripts/bench/benchmark_tp.py --model weights/qwen3-0.6b-shapes            # TP=2 vs TP=1, bf16
    python scripts/bench/benchmark_tp.py --model weights/qwen3-0.6b-shapes --rounds 5 --tokens 96

Each configuration runs in a fresh process (a process holds one tensor-parallel group, and a fresh
process gives honest peak-memory figures); the configurations alternate, round after round, and the
medians are reported. Every run loads the checkpoint laid out for batch-1 decode (the layout the CLI's
generate uses), prefills a 32-token prompt, then decodes --tokens tokens greedily with EOS ignored.
Threads: TP=1 gets all the cores; TP=N gives each rank cores / N (parallel/group.py).

Memory: each rank's peak resident set (VmHWM: torch, the compiled kernels, the weights it read) and,
for reference, rank 0's resident set before loading (the runtime alone). With TP=1 the weights are
the checkpoint's mapped pages; a TP rank's are copies of its slices (parallel/loading.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def vm(pid: int | str, key: str) -> int:
    """A /proc/PID/status field in bytes (VmHWM: peak resident set, VmRSS: now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(model_path: str, world: int, tokens: int, dtype: str, device: str) -> dict:
    """One measured run in this process; returns its figures."""
    import torch

    from qwen3_scratch.checkpoint.weights import load_model
    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.parallel.model import load_parallel_model

    before = vm("self", "VmRSS")
    if world > 1:
        model = load_parallel_model(model_path, world, device, dtype, optimize="decode")
    else:
        model = load_model(model_path, device, dtype, optimize="decode")
    prompt = torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    stamps = []
    for _ in generate_tokens(model, [prompt], tokens, ignore_eos=True):
        if device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    workers = [p.pid for p in model.group.workers] if world > 1 else []
    return {
        "world": world,
        "threads": torch.get_num_threads(),
        "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "rss_before_load": before,
        "peak_rss": [vm("self", "VmHWM")] + [vm(pid, "VmHWM") for pid in workers],
        "rank0_peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "shard_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def allreduce_rank(rank: int, port: int, repeats: int, out) -> None:
    """One of two gloo ranks: the time of one all-reduce of a decode step's hidden state (1024 bf16 values)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(1, 1, 1024, dtype=torch.bfloat16)
    for _ in range(50):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - start) / repeats)
    dist.destroy_process_group()


def allreduce_seconds(repeats: int = 2000) -> float:
    """What the collectives of a step cost on their own: one all-reduce between two processes, over loopback."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=allreduce_rank, args=(r, port, repeats, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    seconds = out.get(timeout=300)
    for p in ranks:
        p.join()
    return seconds


def run(model_path: str, world: int, tokens: int, dtype: str, device: str) -> dict:
    command = [sys.executable, __file__, "--child", str(world), "--model", model_path, "--tokens", str(tokens),
               "--dtype", dtype, "--device", device]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="weights/qwen3-0.6b-shapes")
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to compare (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: rank r on GPU r")
    p.add_argument("--allreduce", action="store_true", help="time one all-reduce of a hidden state, nothing else")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.allreduce:
        print(f"one gloo all-reduce of 1024 bf16 values, 2 processes, 1 thread each: {allreduce_seconds() * 1e6:.0f} us")
        return
    if args.child:
        print(json.dumps(child(args.model, args.child, args.tokens, args.dtype, args.device)))
        return
    sizes = [int(n) for n in args.sizes.split(",")]
    results = {n: [] for n in sizes}
    for r in range(args.rounds):
        for n in sizes if r % 2 == 0 else reversed(sizes):  # alternate the order round by round
            results[n].append(run(args.model, n, args.tokens, args.dtype, args.device))
            print(json.dumps(results[n][-1]), file=sys.stderr)
    print(f"{args.model}, {args.dtype}, {args.tokens} tokens after a 32-token prompt, median of {args.rounds} rounds")
    print("| TP | threads per rank | decode tok/s | peak RSS per rank (MiB) | rank 0 RSS before load (MiB) | "
          "weights per rank (MiB) |\n|---:|---:|---:|---|---:|---:|")  # fmt: skip
    mib = 2**20
    for n, runs in results.items():
        speed = statistics.median(r["decode_tok_s"] for r in runs)
        peaks = [statistics.median(r["peak_rss"][i] for r in runs) / mib for i in range(n)]
        before = statistics.median(r["rss_before_load"] for r in runs) / mib
        print(f"| {n} | {runs[0]['threads']} | {speed:.2f} | {', '.join(f'{x:.0f}' for x in peaks)} | {before:.0f} | "
              f"{runs[0]['shard_weight_bytes'] / mib:.0f} |")


if __name__ == "__main__":
    main()
