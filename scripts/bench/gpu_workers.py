"""The measurements behind scripts/gpu_check.py, one step per process (gpu_check runs each with its own time
limit). Each worker writes its JSON record after every measurement, so a step cut short keeps what it had.

    decode        ours, batch 1, greedy, bf16 (or int8/int4) weights: "graphs" (the default command: CUDA
                  graphs, no compile), "compiled" (--compile: inductor, CUDA graphs) or "eager" (op by op)
    transformers  `generate` eagerly (DynamicCache), and with a StaticCache of one fixed length (transformers
                  then compiles its forward, "reduce-overhead", on a GPU; the same length every call, or it
                  would compile again)
    workload      the engine on nano-vLLM's benchmark workload (scripts/bench/nano_vllm_workload.py's run())
    busy          the fraction of an engine run's wall time the GPU was running kernels (torch.profiler)

Variants of `decode` are "<weights>/<mode>": weights bfloat16, int8 (the device's default int8 route:
gpt-fast's fused cast on a GPU), int8pack (torch._weight_int8pack_mm) or int4 (tinygemm on a GPU).
"""

import importlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent.parent, HERE.parent, HERE.parent / "checkpoints", HERE):  # run from the source tree
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from qwen3_scratch.generation.stats import bytes_per_decode_step, measure_bandwidth, synchronize  # noqa: E402

PROMPT_LEN = 16
SCHEMES = {"bfloat16": (None, None), "int8": ("int8", None), "int8pack": ("int8", "int8pack"), "int4": ("int4", None)}


def progress(message: str) -> None:
    print(f"    {message}", flush=True)


def record_result(record: dict, out: Path, key: str, measure) -> None:
    """record["results"][key] = measure(), or the error it raised; written to `out` either way."""
    start = time.perf_counter()
    try:
        result = measure()
    except Exception as e:  # noqa: BLE001 - recorded, and the next measurement runs
        result = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-800:]}
    record["results"][key] = result
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k not in ("tokens", "trace")}
    progress(f"{key}: {shown} ({time.perf_counter() - start:.1f} s)")
    out.write_text(json.dumps(record))


def prompt_ids(vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()


# ---- ours --------------------------------------------------------------------------------------------------


def time_ours(model, device: str, mode: str, new_tokens: int) -> dict:
    """Decode tok/s after a warm-up generation (which pays the capture or the compile: warmup_s)."""
    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.sampling.logits import LogitsFilter

    how = {"graphs": dict(cuda_graphs=True), "compiled": dict(compile=True), "eager": dict(cuda_graphs=False)}[mode]
    ids = prompt_ids(model.config.vocab_size)

    def run(n):
        start = time.perf_counter()
        steps = generate_tokens(model, [ids], n, LogitsFilter(temperature=0.0), ignore_eos=True, **how)
        first = next(steps)
        synchronize(device)
        ttft = time.perf_counter() - start
        rest = list(steps)
        synchronize(device)
        return ttft, time.perf_counter() - start, torch.cat([first, *rest]).tolist()

    start = time.perf_counter()
    run(min(new_tokens, 8))
    warmup_s = time.perf_counter() - start
    ttft, total, tokens = run(new_tokens)
    return {"decode_tok_s": (new_tokens - 1) / (total - ttft), "ttft_s": ttft, "warmup_s": warmup_s, "tokens": tokens}


def decode_worker(args, out: Path) -> None:
    """Each variant of args.variants on one size: loaded once per weight scheme, in the order given."""
    from gpu_checkpoints import load_or_draw

    from qwen3_scratch.generation.cuda_graph import forget_graphs
    from qwen3_scratch.kernels.quantize import use_int8_route

    record = {"size": args.size, "results": {}}
    record["bandwidth_gb_s"] = measure_bandwidth(args.device) / 1e9
    model, loaded = None, "nothing yet"
    for variant in args.variants.split(","):
        weights, mode = variant.split("/")
        quantize, route = SCHEMES[weights]
        if mode == "compiled" and args.device != "cuda":
            record["results"][variant] = {"skipped": "--compile is for CUDA"}
            out.write_text(json.dumps(record))
            continue
        if loaded != quantize:
            model = None  # one model in memory at a time: 8B twice would not fit beside the cache
            torch.cuda.empty_cache() if args.device == "cuda" else None
            start = time.perf_counter()
            model, record["checkpoint_s"] = load_or_draw(args.size, args.device, args.weights, quantize)
            loaded = quantize
            progress(f"loaded {args.size} ({quantize or 'bf16'}) in {time.perf_counter() - start:.1f} s")
        use_int8_route(model, route or ("fused-cast" if args.device == "cuda" else "cpu"))
        forget_graphs(model)  # a graph captured over the other route's kernels would replay them
        step_bytes = bytes_per_decode_step(model, model.config, PROMPT_LEN + args.new_tokens // 2, 1)

        def measure(mode=mode):
            r = time_ours(model, args.device, mode, args.new_tokens)
            r["util"] = r["decode_tok_s"] * step_bytes / (record["bandwidth_gb_s"] * 1e9)
            return {**r, "bytes_per_step": step_bytes}

        record_result(record, out, variant, measure)


# ---- transformers ------------------------------------------------------------------------------------------


def time_transformers(model, device: str, new_tokens: int, static: bool) -> dict:
    """`generate`'s decode tok/s: (n - 1) tokens over the time n tokens take beyond the first."""
    import warnings

    ids = torch.tensor([prompt_ids(model.config.vocab_size)], device=device)
    cache = None
    if static:  # one length for every call (prompt + the longest run), so its compiled forward is reused
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + new_tokens)

    def run(n):
        kwargs = {} if cache is None else {"past_key_values": cache}
        if cache is not None:
            cache.reset()
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # past_key_values's rename to `cache` in transformers 5
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs)
        synchronize(device)
        return time.perf_counter() - start, out[0, PROMPT_LEN:].tolist()

    start = time.perf_counter()
    run(min(new_tokens, 8))  # the compile, with a static cache on a GPU
    warmup_s = time.perf_counter() - start
    first, _ = run(1)
    total, tokens = run(new_tokens)
    result = {"decode_tok_s": (new_tokens - 1) / (total - first), "ttft_s": first, "warmup_s": warmup_s,
              "tokens": tokens}  # fmt: skip
    if static:
        result["compiled"] = torch.device(device).type == "cuda"
    return result


def transformers_worker(args, out: Path) -> None:
    from gpu_checkpoints import checkpoint_folder
    from transformers import AutoModelForCausalLM

    record = {"size": args.size, "results": {}}
    folder = checkpoint_folder(args.size, args.device, args.weights)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(args.device).eval()
    for variant in args.variants.split(","):
        new_tokens = args.new_tokens if variant == "static-compile" else min(args.new_tokens, 32)  # eager is slow
        record_result(record, out, f"transformers/{variant}",
                      lambda v=variant, n=new_tokens: time_transformers(model, args.device, n, v == "static-compile"))


# ---- the engine --------------------------------------------------------------------------------------------


def workload_worker(args, out: Path) -> None:
    """nano-vLLM's benchmark workload through the engine, by the engine's own script, if it is there."""
    from gpu_checkpoints import checkpoint_folder

    record = {"size": args.size, "results": {}}
    try:
        workload = importlib.import_module("nano_vllm_workload")
    except ImportError as e:
        record["results"]["engine/workload"] = {"skipped": f"not available: scripts/bench/nano_vllm_workload.py ({e})"}
        out.write_text(json.dumps(record))
        return
    folder = checkpoint_folder(args.size, args.device, args.weights)
    import torch

    kwargs = {"model_path_or_model": str(folder), "device": args.device, "seed": 0,
              "dtype": torch.bfloat16 if args.device == "cuda" else torch.float32}  # fmt: skip
    if args.size == "tiny":  # the dry run: a few short requests
        kwargs |= {"num_requests": 4, "max_len": 24}
    else:  # nano-vLLM's 256 requests did not finish inside the step's 76 s on an H100 (first run): a quarter of them
        kwargs |= {"num_requests": 64}
    record["run_kwargs"] = {k: str(v) for k, v in kwargs.items()}
    record_result(record, out, "engine/workload", lambda: workload.run(**kwargs))
    # FlexAttention over the pool in place, with decode graphs: opt-in until it compiles and wins on a GPU
    record_result(record, out, "engine/workload flex", lambda: workload.run(**kwargs, route="flex"))


def busy_worker(args, out: Path) -> None:
    """64 prompts of 32 random tokens, 32 new tokens each, through LLMEngine under torch.profiler: the union
    of the GPU's kernel intervals over the wall time (after a warm-up run, so captures do not count)."""
    from gpu_checkpoints import load_or_draw
    from torch.profiler import ProfilerActivity, profile

    from qwen3_scratch.engine.engine import LLMEngine
    from qwen3_scratch.sampling.params import SamplingParams

    record = {"size": args.size, "results": {}}
    model, _ = load_or_draw(args.size, args.device, args.weights, None, optimize="batch")
    engine = LLMEngine(model, None, eos_ids=[], num_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = torch.randint(0, model.config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(1)).tolist()

    def run_all(n):
        for i, ids in enumerate(prompts[:n]):
            engine.add_request(f"r{time.perf_counter_ns()}-{i}", ids, params)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        synchronize(args.device)
        return steps

    def measure():
        run_all(8)
        cuda = args.device == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            start = time.perf_counter()
            steps = run_all(len(prompts))
            wall = time.perf_counter() - start
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
        busy_s = union_seconds(kernels)
        return {"wall_s": wall, "steps": steps, "output_tok_s": len(prompts) * 32 / wall, "gpu_busy_s": busy_s,
                "gpu_busy_fraction": busy_s / wall if kernels else None}  # fmt: skip

    record_result(record, out, "engine/busy", measure)


def union_seconds(intervals_us: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals in microseconds, in seconds (overlapping kernels
    on several streams count once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals_us):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6


WORKERS = {"decode": decode_worker, "transformers": transformers_worker, "workload": workload_worker,
           "busy": busy_worker}  # fmt: skip


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="one of scripts/gpu_check.py's steps (it runs these)")
    p.add_argument("kind", choices=sorted(WORKERS))
    p.add_argument("--size", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON record")
    args = p.parse_args(argv)
    WORKERS[args.kind](args, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
