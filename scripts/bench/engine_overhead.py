"""The engine's host overhead per step: a step's wall time minus its forwards' time, and forwards per step.

    python scripts/bench/engine_overhead.py                     # tiny random model, CPU, 64 rows
    python scripts/bench/engine_overhead.py --device cuda --checkpoint weights/Qwen3-0.6B

Two measurements, alternating nothing with nothing else (one engine, one process):
  - decode: `rows` requests decoding together (after their prefill), `steps` steps timed; per step the wall
    time of `engine.step()` and the time spent inside the model's forward (a pre- and post-hook on the
    model; on a GPU each synchronised). Overhead = step - forward: scheduling, packing the batch, copying
    inputs, sampling, detokenizing, bookkeeping. Target: <= 2 ms at 64 rows on a CPU (issue 29).
  - prefill: `prompts` prompts added at once, the first step timed, its forwards counted. Target: 1.
With CUDA graphs a decode forward is a replay: the hooks see no model call then, so the "forward" time of a
replayed step is the replay itself, timed around the runner's graph call.
"""

import argparse
import statistics
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
from qwen3_scratch.sampling.params import SamplingParams  # noqa: E402


class ForwardClock:
    """Time spent inside the model's forwards (and graph replays), and how many ran."""

    def __init__(self, model, runner, device):
        self.total, self.count, self.cuda = 0.0, 0, torch.device(device).type == "cuda"
        model.register_forward_pre_hook(lambda *a: self._start())
        model.register_forward_hook(lambda *a: self._stop())
        graphs = getattr(runner, "graphs", None)
        if graphs is not None:  # a replay calls no module: time the graph runner instead
            run = graphs.run

            def timed(batch):
                self._start()
                out = run(batch)
                self._stop(replay=out is not None)
                return out

            graphs.run = timed
        self._began = None

    def _start(self):
        if self._began is None:
            self._sync()
            self._began = time.perf_counter()

    def _stop(self, replay=True):
        if self._began is not None and replay:
            self._sync()
            self.total += time.perf_counter() - self._began
            self.count += 1
        self._began = None

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def random_prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode_overhead(engine, clock, rows, steps, prompt_len, vocab, temperature=0.0, seeded=False):
    for i, ids in enumerate(random_prompts(rows, prompt_len, vocab, seed=1)):
        seed = i if seeded else None
        params = SamplingParams(temperature=temperature, max_tokens=steps + 8, ignore_eos=True, seed=seed)
        engine.add_request(f"d{i}", ids, params)
    while any(seq.num_computed < seq.num_prompt_tokens for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()  # warm
    walls, forwards, counts = [], [], []
    for _ in range(steps):
        before, n = clock.total, clock.count
        if clock.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if clock.cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        forwards.append(clock.total - before)
        counts.append(clock.count - n)
    while engine.has_unfinished():
        engine.step()
    over = [w - f for w, f in zip(walls, forwards)]
    return {"rows": rows, "step_ms": statistics.median(walls) * 1e3, "forward_ms": statistics.median(forwards) * 1e3,
            "overhead_ms": statistics.median(over) * 1e3, "forwards_per_step": statistics.median(counts)}  # fmt: skip


def prefill_forwards(engine, clock, prompts, prompt_len, vocab):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, ids in enumerate(random_prompts(prompts, prompt_len, vocab, seed=2)):
        engine.add_request(f"p{i}", ids, params)
    n = clock.count
    start = time.perf_counter()
    engine.step()
    wall, forwards = time.perf_counter() - start, clock.count - n
    while engine.has_unfinished():
        engine.step()
    return {"prompts": prompts, "first_step_forwards": forwards, "first_step_ms": wall * 1e3}


def run(model_path_or_model, device="cpu", rows=64, steps=30, prompts=8, prompt_len=24, dtype=None, temperature=0.0,
        seeded=False) -> dict:  # fmt: skip
    """temperature, seeded: the decode rows' sampling (greedy by default; nano-vLLM's workload draws at 0.6,
    and nano_vllm_workload.py seeds every request)."""
    if isinstance(model_path_or_model, (str, Path)):
        model = load_model(model_path_or_model, device=device, dtype=dtype or torch.float32, optimize="batch")
    else:
        model = model_path_or_model
    vocab = model.config.vocab_size
    # steps read at once, even on a GPU: the host's own cost a step is the figure (overlapped steps hide it behind
    # the GPU's, and the clock's synchronisations would serialise them anyway); nano_vllm_workload.py times both
    engine = LLMEngine(model, None, [], num_blocks=rows * (-(-(prompt_len + steps + 16) // 16)) + 64, block_size=16,
                       max_num_seqs=max(rows, prompts), max_num_batched_tokens=max(512, prompts * prompt_len),
                       async_scheduling=False)  # fmt: skip
    clock = ForwardClock(model, engine.runner, device)
    result = {"device": str(device)}
    result.update(decode_overhead(engine, clock, rows, steps, prompt_len, vocab, temperature, seeded))
    result.update(prefill_forwards(engine, clock, prompts, prompt_len, vocab))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a checkpoint folder (default: a tiny random one, written to a temp dir)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s: a tiny model)")
    p.add_argument("--temperature", type=float, default=0.0, help="the decode rows' (default greedy)")
    p.add_argument("--seeded", action="store_true", help="each decode row with a seed of its own (its own generator)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint
    if checkpoint is None:
        import tempfile

        from make_tiny_checkpoint import make_tiny_checkpoint

        checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    from machine import cpu_info

    result = run(checkpoint, args.device, args.rows, args.steps, args.prompts, dtype=getattr(torch, args.dtype),
                 temperature=args.temperature, seeded=args.seeded)  # fmt: skip
    print(f"cpu: {cpu_info()[0]}, torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    how = f"temperature {args.temperature:g}" + (", seeded" if args.seeded else "") if args.temperature else "greedy"
    print(f"decode, {result['rows']} rows ({how}): step {result['step_ms']:.2f} ms = forward {result['forward_ms']:.2f} ms "
          f"+ host overhead {result['overhead_ms']:.2f} ms (target <= 2 ms); {result['forwards_per_step']:g} "
          f"forward(s) per step")  # fmt: skip
    print(f"prefill of {result['prompts']} prompts at once: {result['first_step_forwards']} forward(s) in the first "
          f"step (target 1), {result['first_step_ms']:.1f} ms")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
