"""nano-vLLM's benchmark workload through our engine: output tokens per second, and on a GPU how busy it was.

    python scripts/bench/nano_vllm_workload.py --checkpoint weights/Qwen3-0.6B --device cuda   # the full workload
    python scripts/bench/nano_vllm_workload.py --num-requests 16 --max-len 64                  # CPU, tiny model

The workload is nano-vllm's bench.py: 256 requests, each prompt 100-1024 random token ids (below 10,000),
each output 100-1024 tokens with ignore_eos, temperature 0.6, all drawn from Python's random.seed(0); all
requests are added at once and the engine runs them to the end. nano-vLLM reports 1,315 output tok/s on
an RTX 4070 and vLLM 1,354 (issue 29; the target on an H100 is >= 15,000 with the GPU busy >= 80%).
--num-requests and --max-len scale it down (lengths then from min(100, max-len) to max-len).

GPU busy fraction: a window of engine steps after the timed run (prefills, then decodes) under torch.profiler,
the union of the GPU kernels' intervals over the window's wall time.
scripts/gpu_check.py calls `run(...)` and gets a dict back.
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "bench", ROOT / "scripts" / "checkpoints"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.engine.engine import LLMEngine  # noqa: E402
from qwen3_scratch.engine.llm import default_num_blocks  # noqa: E402
from qwen3_scratch.engine.model_runner import ModelRunner  # noqa: E402
from qwen3_scratch.sampling.params import SamplingParams  # noqa: E402


def workload(num_requests=256, max_len=1024, seed=0, vocab=10_000):
    """[(prompt ids, max_tokens)] as nano-vllm's bench.py draws them (ids below min(10,000, vocab))."""
    rng = random.Random(seed)
    low, top = min(100, max_len), min(10_000, vocab) - 1
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(low, max_len))] for _ in range(num_requests)]
    return [(ids, rng.randint(low, max_len)) for ids in prompts]


def pool_blocks(model, requests, block_size, max_num_seqs) -> int:
    """The KV pool: from free GPU memory on a GPU (the engine's default rule), else all requests' tokens."""
    if model.device.type == "cuda":
        from qwen3_scratch.engine.llm import gpu_kv_memory_gib

        gib = gpu_kv_memory_gib(model.config, model.device, 0.9, 16384, model.activation_dtype.itemsize)
        return default_num_blocks(model.config, model.activation_dtype.itemsize, block_size, gib, max_num_seqs)
    return sum(-(-(len(ids) + n) // block_size) for ids, n in requests) + 8


def generate(engine, requests, temperature, split: dict | None = None) -> int:
    """Run requests to the end; the output tokens. split: filled with steps and seconds by kind ("replayed":
    a decode step from its bucket's CUDA graph; "eager": any other, a prefill among them)."""
    for i, (ids, n) in enumerate(requests):
        engine.add_request(str(i), ids, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i))
    produced = 0
    graphs = engine.runner.graphs
    while engine.has_unfinished():
        before, start = (graphs.replays if graphs is not None else 0), time.perf_counter()
        produced += sum(len(out.new_token_ids) for out in engine.step())
        if split is not None:
            kind = "replayed" if graphs is not None and graphs.replays > before else "eager"
            steps, seconds = split.get(kind, (0, 0.0))
            split[kind] = (steps + 1, seconds + time.perf_counter() - start)
    return produced


def host_profile(engine, requests, temperature, steps: int, top: int = 14) -> dict:
    """cProfile over the prefill steps of `requests`, then over `steps` decode steps: the host functions that
    take the longest (own time), which is where a host-bound step's time goes (on a GPU, a function that waits
    for the device shows that wait as its own time). The profiler slows Python itself, so the shares count, not
    the totals. {"prefill": rows, "prefill_steps", "prefill_s", "decode": rows}."""
    import cProfile

    for i, (ids, n) in enumerate(requests):
        engine.add_request(f"host{i}", ids, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                                           seed=i))  # fmt: skip
    scheduler = engine.scheduler
    prefill, prefill_steps, start = cProfile.Profile(), 0, time.perf_counter()
    prefill.enable()
    while scheduler.waiting or any(seq.num_computed < seq.num_prompt_tokens for seq in scheduler.running):
        engine.step()
        prefill_steps += 1
    prefill.disable()
    prefill_s = time.perf_counter() - start
    decode = cProfile.Profile()
    decode.enable()
    for _ in range(steps):
        if engine.has_unfinished():
            engine.step()
    decode.disable()
    for i in range(len(requests)):
        engine.abort(f"host{i}")
    return {"prefill": costliest(prefill, max(1, prefill_steps), top), "prefill_steps": prefill_steps,
            "prefill_s": round(prefill_s, 3), "decode": costliest(decode, steps, top)}


def costliest(profiler, steps: int, top: int) -> list[dict]:
    """A cProfile's `top` functions by own time, per step."""
    import pstats

    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own, cumulative, ...)}
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line} {name}", "calls_per_step": round(v[0] / steps, 1),
             "own_ms_per_step": round(v[2] / steps * 1e3, 3), "share": round(v[2] / total, 3)}
            for (f, line, name), v in rows]  # fmt: skip


def union_seconds(intervals_us: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals in microseconds, in seconds (overlapping kernels
    on several streams count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals_us):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6


def busy_window(engine, requests, temperature, steps: int) -> dict:
    """The GPU's busy fraction over `steps` engine steps of `requests` (its first prefills, then decodes),
    under torch.profiler: the union of the kernels' intervals over the window's wall time. A window, not a
    whole run: an eager run records ~1,000 kernels a step, and the profiler's post-processing of a whole
    run took longer than the run."""
    from torch.profiler import ProfilerActivity, profile

    for i, (ids, n) in enumerate(requests):
        engine.add_request(f"busy{i}", ids, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: the host's ops are not needed
        start, done = time.perf_counter(), 0
        while engine.has_unfinished() and done < steps:
            engine.step()
            done += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    for i in range(len(requests)):  # the rest is not measured
        engine.abort(f"busy{i}")
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    busy = union_seconds(kernels)
    return {"gpu_busy": busy / wall, "gpu_busy_s": busy, "busy_window_s": wall, "busy_window_steps": done}


def run(model_path_or_model, device="cpu", num_requests=256, max_len=1024, seed=0, dtype=None, temperature=0.6,
        max_num_seqs=None, max_num_batched_tokens=None, block_size=16, profile_busy=True, route=None,
        busy_steps=24, host_steps=0, async_scheduling=None) -> dict:  # fmt: skip
    """The workload once to warm up (a few requests, and every decode bucket's graph up to the request count),
    then timed. A dict of the figures. route: the engine's attention route (model_runner.py; default the
    engine's own choice); on a GPU, then `busy_steps` steps under the profiler (busy_window); `host_steps`
    decode steps, and the prefills before them, under cProfile (host_profile). async_scheduling: the engine's
    (default: on a GPU)."""
    cuda = torch.device(device).type == "cuda"
    if isinstance(model_path_or_model, (str, Path)):
        dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        model = load_model(model_path_or_model, device=device, dtype=dtype, optimize="batch")
    else:
        model = model_path_or_model
    requests = workload(num_requests, max_len, seed, model.config.vocab_size)
    max_num_seqs = max_num_seqs or (256 if cuda else 64)
    max_num_batched_tokens = max_num_batched_tokens or (8192 if cuda else 512)
    start = time.perf_counter()
    engine = LLMEngine(model, None, [], pool_blocks(model, requests, block_size, max_num_seqs), block_size,
                       max_num_seqs, max_num_batched_tokens, async_scheduling=async_scheduling)  # fmt: skip
    if route is not None:
        engine.runner = ModelRunner(model, engine.cache, route=route, max_rows=max_num_seqs)
    print(f"    workload: {num_requests} requests, pool {engine.blocks.num_blocks} blocks, route "
          f"{engine.runner.route}; warming up", flush=True)  # fmt: skip
    engine.runner.warm_up(min(num_requests, max_num_seqs))
    generate(engine, [(ids[:32], 8) for ids, _ in requests[: min(len(requests), max_num_seqs)]], temperature)
    warmup = time.perf_counter() - start
    print(f"    workload: warm-up {warmup:.1f} s; timing", flush=True)
    result = {"device": str(device), "requests": num_requests, "max_len": max_len, "warmup_s": warmup,
              "prompt_tokens": sum(len(ids) for ids, _ in requests), "blocks": engine.blocks.num_blocks}  # fmt: skip
    if cuda:
        torch.cuda.synchronize()
    start, split = time.perf_counter(), {}
    produced = generate(engine, requests, temperature, split)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    runner = engine.runner
    result.update(output_tokens=produced, seconds=wall, output_tok_s=produced / wall, forwards=runner.num_forwards,
                  preemptions=engine.num_preemptions, route=runner.route, fallback=runner.fallback,
                  async_scheduling=engine.async_scheduling)  # fmt: skip
    for kind, (steps, seconds) in split.items():  # where the wall time went, by kind of step
        result[f"{kind}_steps"], result[f"{kind}_ms_per_step"] = steps, seconds / steps * 1e3
    if host_steps:
        result["host_profile"] = host_profile(engine, requests[: max(1, len(requests) // 2)], temperature, host_steps)
    if cuda and profile_busy:  # a second, profiled window: the profiler's own cost stays out of the tok/s
        print(f"    workload: {produced / wall:.0f} output tok/s; profiling {busy_steps} steps", flush=True)
        result.update(busy_window(engine, requests[: max(1, len(requests) // 2)], temperature, busy_steps))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a checkpoint folder (default: a tiny random one, written to a temp dir)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint
    if checkpoint is None:
        import tempfile

        from make_tiny_checkpoint import make_tiny_checkpoint

        checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    from machine import cpu_info

    r = run(checkpoint, args.device, args.num_requests, args.max_len, args.seed)
    gpu = f", {torch.cuda.get_device_name(args.device)}" if r["device"].startswith("cuda") else ""
    print(f"cpu: {cpu_info()[0]}{gpu}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    busy = f", GPU busy {r['gpu_busy']:.0%}" if "gpu_busy" in r else ""
    print(f"{r['requests']} requests (prompts {r['prompt_tokens']} tokens, outputs up to {r['max_len']}): "
          f"{r['output_tokens']} output tokens in {r['seconds']:.2f} s = {r['output_tok_s']:.0f} output tok/s, "
          f"{r['forwards']} forwards (warm-up included), {r['preemptions']} preemptions{busy}")  # fmt: skip
    return r


if __name__ == "__main__":
    main()
