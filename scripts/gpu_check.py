"""The GPU check in one command, for a machine with a CUDA GPU and no internet:

    python scripts/gpu_check.py --out gpu-check/                      # H100: under 9 minutes
    python scripts/gpu_check.py --device cpu --sizes tiny --out /tmp/x  # the dry run CI runs

Needs torch, transformers, safetensors, tokenizers and huggingface_hub; runs from the source tree
(this package need not be installed). Steps, each isolated (its own subprocess and time limit; a
failure is recorded in the JSON and the next step runs):
  1. the CUDA tests: `pytest -m cuda`;
  2. per size (0.6B, 1.7B, 4B, 8B): write a random checkpoint of the exact shapes (drawn on the GPU,
     so 8B takes seconds), then decode greedily, batch 1, in bf16, int8 and int4, eager (KV cache) and
     compiled (CUDA graphs), against the GPU's bandwidth limit measured in the same process;
  3. the load benchmark onto the GPU (scripts/bench/benchmark_load.py --device cuda);
  4. with >= 2 GPUs, tensor parallelism: TP=2 against TP=1 decode on the 0.6B shapes, and the TP=2
     parity tests on NCCL (scripts/bench/benchmark_tp.py --device cuda; tests/test_tensor_parallel.py runs gloo).
It writes gpu_check.json and gpu_check.md into --out after every step, so a run cut short keeps
what it measured. A step that would start after --budget seconds is recorded as skipped.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for folder in (ROOT, HERE / "checkpoints"):  # the package need not be installed
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
            bos_token_id=0, eos_token_id=1)  # Qwen3's ids (151643...) are outside a 512-token vocabulary  # fmt: skip
# Qwen3-30B-A3B's routing (top-8 of 128 experts) at the tiny widths, for the dry run of the MoE path.
TINY_MOE = {**TINY, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32}
# (name, quantize); activations are bf16 in all three. int4 runs torch's `_weight_int4pack_mm` on CUDA
# (kernels/int4.py: tinygemm's packing, group 32, a scale and zero point per group)
VARIANTS = [("bfloat16", None), ("int8", "int8"), ("int4", "int4")]
ENGINES = ("eager", "compiled")
STEP_LIMITS = {"tests": 150, "decode": 170, "load": 90, "tp": 150}  # seconds per step; decode per size


# ---- worker: one size's decode, in its own process ---------------------------------------------------


def write_checkpoint(size: str, folder: Path, device: str) -> Path:
    """Random weights of the exact shapes, drawn on `device` (fast on a GPU), one shard at a time."""
    import torch
    from make_shape_checkpoint import (
        GB,
        generation_config,
        plan_shards,
        shape_config,
        shard_file_names,
        tensor_shapes,
        write_json,
    )  # fmt: skip
    from safetensors.torch import save_file

    config = shape_config("0.6B" if size == "tiny" else size, "bfloat16", TINY if size == "tiny" else None)
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    shards = plan_shards(shapes, 2, 4 * GB)
    names = shard_file_names(len(shards))
    weight_map = {}
    for name, keys in zip(names, shards):
        tensors = {}
        for key in keys:
            t = torch.empty(shapes[key], dtype=torch.bfloat16, device=device).normal_(0, 0.02)
            tensors[key] = (t.add_(1.0) if key.endswith("norm.weight") else t).cpu()
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    if len(names) > 1:
        write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    write_json(folder / "generation_config.json", generation_config(config))
    write_json(folder / "config.json", config)  # last: a half-written folder has no config
    return folder


def random_moe_model(size: str, device: str, quantize: str | None):
    """An MoE model of `size`'s shapes with random bf16 weights drawn straight on `device`: no checkpoint.

    30B-A3B is 61 GB in bf16: it fits an 80 GB GPU but not, beside the dense sizes, the GPU machine's disk,
    and writing and reading it back would spend the step's time limit. Decode speed does not depend on where
    the random numbers came from. Built on `meta` in bf16, then materialised on the device in place.
    """
    import torch
    from make_shape_checkpoint import shape_config

    from qwen3_scratch.kernels.fuse import fuse_projections
    from qwen3_scratch.kernels.quantize import quantize_model
    from qwen3_scratch.model.config import Qwen3Config
    from qwen3_scratch.model.qwen3 import Qwen3

    config = Qwen3Config.from_dict(shape_config("30B-A3B" if size == "tiny-moe" else size, "bfloat16",
                                                TINY_MOE if size == "tiny-moe" else None))  # fmt: skip
    with torch.device("meta"):
        model = Qwen3(config).to(torch.bfloat16)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.02).add_(1.0 if name.endswith("norm.weight") else 0.0)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.build_rope_tables(device, torch.bfloat16)
    fuse_projections(model)
    if quantize is not None:
        quantize_model(model, quantize)
    return model.eval()


def time_decode(model, device: str, compile: bool, new_tokens: int, prompt_len: int = 16) -> dict:
    import torch

    from qwen3_scratch.generation.loops import generate_tokens
    from qwen3_scratch.generation.stats import synchronize
    from qwen3_scratch.sampling.logits import LogitsFilter

    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    greedy = LogitsFilter(temperature=0.0)

    def run(n):
        start = time.perf_counter()
        tokens = generate_tokens(model, [prompt.tolist()], n, greedy, ignore_eos=True, compile=compile)
        first = next(tokens)
        synchronize(device)
        ttft = time.perf_counter() - start
        rest = list(tokens)
        synchronize(device)
        return ttft, time.perf_counter() - start, torch.cat([first, *rest]).tolist()

    start = time.perf_counter()
    run(min(new_tokens, 8))  # warm-up; for compiled: the compile itself
    warmup_s = time.perf_counter() - start
    ttft, total, tokens = run(new_tokens)
    return {"decode_tok_s": (new_tokens - 1) / (total - ttft), "ttft_s": ttft, "warmup_s": warmup_s, "tokens": tokens}


def decode_worker(size: str, device: str, weights: Path, new_tokens: int, out: Path) -> None:
    """Every (dtype, engine) of one size; each result or error written to `out` as soon as it exists."""
    import torch

    from qwen3_scratch.checkpoint.weights import load_model
    from qwen3_scratch.generation.stats import bytes_per_decode_step, measure_bandwidth

    record = {"size": size, "results": {}}
    start = time.perf_counter()
    moe = size == "tiny-moe" or "-A" in size  # 30B-A3B, 235B-A22B: drawn in memory, see random_moe_model
    folder = None if moe else write_checkpoint(size, weights / f"qwen3-{size.lower()}-shapes-gpucheck", device)
    record["checkpoint_s"] = round(time.perf_counter() - start, 1)
    record["bandwidth_gb_s"] = measure_bandwidth(device) / 1e9
    for name, quantize in VARIANTS:
        try:
            if moe:
                model = random_moe_model(size, device, quantize)
            else:
                model = load_model(folder, device, "bfloat16", optimize="decode", quantize=quantize)
        except Exception as e:  # noqa: BLE001 - recorded, and the next variant runs
            record["results"][name] = {"error": f"load: {type(e).__name__}: {e}"}
            continue
        step_bytes = bytes_per_decode_step(model, model.config, 16 + new_tokens // 2, 1)
        for engine in ENGINES:
            key = f"{name}/{engine}"
            if engine == "compiled" and device != "cuda":
                record["results"][key] = {"skipped": "CUDA graphs need CUDA"}
                continue
            if engine == "compiled" and model.config.num_experts:
                record["results"][key] = {"skipped": "which experts run depends on the data: no fixed graph"}
                continue
            try:
                r = time_decode(model, device, engine == "compiled", new_tokens)
                r["util"] = r["decode_tok_s"] * step_bytes / (record["bandwidth_gb_s"] * 1e9)
                r["bytes_per_step"] = step_bytes
                record["results"][key] = r
            except Exception as e:  # noqa: BLE001
                record["results"][key] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-800:]}
            out.write_text(json.dumps(record))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    out.write_text(json.dumps(record))


# ---- the parent: steps, budget, report ---------------------------------------------------------------


def run_step(command: list[str], limit: float) -> dict:
    """A subprocess with a time limit; its exit code, duration and the tail of its output."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE / "checkpoints"), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT, env=env)
        result = {"returncode": done.returncode, "output_tail": (done.stdout + done.stderr)[-2000:]}
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        result = {"returncode": None, "error": f"timed out after {limit:.0f} s",
                  "output_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else str(tail)}  # fmt: skip
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="CUDA tests, decode at 0.6B-8B shapes and the load benchmark, in one run.")
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run")
    p.add_argument("--sizes", default="0.6B,1.7B,4B,8B,30B-A3B",
                   help="Qwen3 shapes (MoE ones drawn in GPU memory), or 'tiny,tiny-moe' for the dry run")  # fmt: skip
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--weights", type=Path, default=ROOT / "weights", help="where the random checkpoints go")
    p.add_argument("--budget", type=float, default=510, help="seconds after which no new step starts")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one size's decode
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        decode_worker(args.worker, args.device, args.weights, args.new_tokens, args.worker_out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(args.device), "command": "python scripts/gpu_check.py " + " ".join(argv or sys.argv[1:]),
              "steps": {}}  # fmt: skip
    start = time.perf_counter()
    for name, step in plan(args):
        if time.perf_counter() - start > args.budget:
            report["steps"][name] = {"skipped": f"time budget of {args.budget:.0f} s spent"}
        else:
            report["steps"][name] = step()
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        write_report(report, args.out)
    print(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md in {report['elapsed_s']} s")
    return 0


def plan(args):
    """(step name, a function that runs it) in order."""
    py = sys.executable
    if args.device == "cuda":
        yield "cuda tests", lambda: run_step([py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"], STEP_LIMITS["tests"])
    else:
        yield "cuda tests", lambda: {"skipped": "no CUDA device (dry run)"}
    for size in args.sizes.split(","):
        yield f"decode {size}", lambda size=size: decode_step(args, size)
    if args.device == "cuda":
        load = [py, str(HERE / "bench" / "benchmark_load.py"), "--device", "cuda", "--repeats", "3",
                "--checkpoint", str(args.weights / "qwen3-0.6b-shapes-gpucheck"), "--json", str(args.out / "load.json")]  # fmt: skip
        yield "load benchmark", lambda: run_step(load, STEP_LIMITS["load"])
    else:
        yield "load benchmark", lambda: {"skipped": "the load benchmark measures loading onto a GPU"}
    if args.device == "cuda" and gpu_count() >= 2:
        tp = [py, str(HERE / "bench" / "benchmark_tp.py"), "--device", "cuda", "--sizes", "1,2", "--tokens", "128",
              "--model", str(args.weights / "qwen3-0.6b-shapes-gpucheck")]  # fmt: skip
        yield "tensor parallel", lambda: run_step(tp, STEP_LIMITS["tp"])
    else:
        yield "tensor parallel", lambda: {"skipped": "tensor parallelism needs 2 or more CUDA GPUs"}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def decode_step(args, size: str) -> dict:
    out = args.out / f"decode_{size}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--device", args.device,
               "--worker", size, "--worker-out", str(out), "--weights", str(args.weights),
               "--new-tokens", str(args.new_tokens)]  # fmt: skip
    result = run_step(command, STEP_LIMITS["decode"])
    if out.exists():  # whatever the worker measured before it ended, even if it then failed
        result.update(json.loads(out.read_text()))
    return result


def machine(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "device": device}
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    info["cpu"] = cpu[0].split(":", 1)[1].strip() if cpu else "?"
    return info


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# GPU check: {report['machine'].get('gpu', report['machine']['cpu'])}", "",
             f"`{report['command']}`, {report.get('elapsed_s', 0)} s, torch {report['machine']['torch']}", "",
             "| step | result |", "|---|---|"]  # fmt: skip
    for name, step in report["steps"].items():
        lines.append(f"| {name} | {summary(step)} |")
    lines += ["", "| size | variant | decode tok/s | % of bandwidth limit | TTFT (s) | warm-up / compile (s) |",
              "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, step in report["steps"].items():
        for key, r in step.get("results", {}).items():
            if "decode_tok_s" in r:
                lines.append(f"| {step['size']} | {key} | {r['decode_tok_s']:.1f} | {r['util']:.0%} | "
                             f"{r['ttft_s']:.3f} | {r['warmup_s']:.1f} |")  # fmt: skip
            else:
                lines.append(f"| {step['size']} | {key} | {r.get('error') or r.get('skipped')} | | | |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def summary(step: dict) -> str:
    if "skipped" in step:
        return f"skipped: {step['skipped']}"
    if step.get("error"):
        return step["error"]
    ok = step.get("returncode") == 0
    last = (step.get("output_tail") or "").strip().splitlines()[-1:] or [""]
    return f"{'ok' if ok else 'FAILED (exit ' + str(step.get('returncode')) + ')'} in {step.get('seconds')} s: {last[0][:120]}"


if __name__ == "__main__":
    raise SystemExit(main())
