"""The engine's throughput with and without speculation (engine/speculative.py), side by side in one process.

    python scripts/bench/engine_speculative.py                              # tiny random model, CPU
    python scripts/bench/engine_speculative.py --checkpoint weights/Qwen3-0.6B --dtype bfloat16
    python scripts/bench/engine_speculative.py --draft self                 # the model drafting for itself
    python scripts/bench/engine_speculative.py --checkpoint weights/Qwen3-1.7B --draft weights/Qwen3-0.6B

Prompt lookup by default; --draft PATH proposes with that draft model (engine/draft_proposer.py), --draft self
with the model itself: every proposal is kept, so it shows the machinery's ceiling and what the draft's
forwards cost when the draft is as large as the target.

Two workloads of `--requests` concurrent requests (16), each run by a plain engine and a speculating one
over the same model, alternated `--repeats` times; the figure is output tokens / wall time of the whole
run (all requests added at once, stepped until the last one finishes), the median over repeats:
  - quoting: greedy answers that repeat what came before. With no trained model at hand, the prompts are a
    random span said three times, and a random model's greedy answer falls into loops within a few tokens:
    the proposals are mostly right, as when an answer quotes its prompt. Target: >= 1.5x.
  - no-accept: sampled answers (temperature 1) after prompts made of a few distinct tokens, so every
    lookup finds a match and proposes, and nearly every proposal is rejected: what speculation costs
    where it cannot help, once it backs off. Target: <= 5% slower.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts", ROOT / "scripts" / "bench", ROOT / "scripts" / "checkpoints"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from machine import Table, machine, machine_line  # noqa: E402

from qwen3_scratch.checkpoint.weights import load_model  # noqa: E402
from qwen3_scratch.engine.engine import LLMEngine  # noqa: E402
from qwen3_scratch.sampling.params import SamplingParams  # noqa: E402


def workloads(requests: int, vocab: int, max_tokens: int) -> dict[str, list[tuple[list[int], SamplingParams]]]:
    g = torch.Generator().manual_seed(0)
    span = lambda n, high: torch.randint(3, high, (n,), generator=g).tolist()  # noqa: E731
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    quoting = [(span(24, vocab) * 3, greedy) for _ in range(requests)]
    few = [torch.randperm(vocab - 3, generator=g)[:8].add(3).tolist() for _ in range(requests)]
    no_accept = [([few[i][j] for j in torch.randint(0, 8, (72,), generator=g).tolist()],
                  SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i))
                 for i in range(requests)]  # fmt: skip
    return {"quoting": quoting, "no-accept": no_accept}


def throughput(engine: LLMEngine, work, tag: str) -> tuple[float, float]:
    """Output tokens per second of one run of `work` through `engine`: per wall second, and per second of this
    process's CPU time (on a shared host the second moves far less with the other processes' load)."""
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for i, (ids, params) in enumerate(work):
        engine.add_request(f"{tag}-{i}", ids, params)
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a checkpoint folder (default: a tiny random one, written to a temp dir)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--workload", choices=["quoting", "no-accept"], help="run only this one (default: both)")
    p.add_argument("--draft", help="a draft model's folder, or 'self' (default: prompt lookup)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s: a tiny model on a shared host)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from make_tiny_checkpoint import make_tiny_checkpoint

        checkpoint = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    model = load_model(checkpoint, dtype=getattr(torch, args.dtype), optimize="batch")
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft is not None:
        draft = checkpoint if args.draft == "self" else args.draft
        config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.num_speculative_tokens}
    blocks = args.requests * (-(-(72 + args.max_tokens + 16) // 16)) + 64
    make = lambda spec: LLMEngine(model, None, [], num_blocks=blocks, max_num_seqs=args.requests,  # noqa: E731
                                  speculative_config=spec)  # fmt: skip
    print(machine_line(machine("cpu")))
    print(f"checkpoint {checkpoint}, {args.dtype}, {args.requests} requests x {args.max_tokens} tokens, "
          f"k = {args.num_speculative_tokens}, {args.threads} threads, median of {args.repeats}")  # fmt: skip
    table = Table("workload", "plain tok/s", f"{config['method']} tok/s", "speed-up", "speed-up, CPU time",
                  "accepted / proposed")  # fmt: skip
    for name, work in workloads(args.requests, model.config.vocab_size, args.max_tokens).items():
        if args.workload not in (None, name):
            continue
        plain, spec = make(None), make(config)
        throughput(plain, work, "warm"), throughput(spec, work, "warm")
        rates = {"plain": [], "spec": []}
        for r in range(args.repeats):  # alternated, so drift in the machine's speed hits both alike
            rates["plain"].append(throughput(plain, work, f"p{r}"))
            rates["spec"].append(throughput(spec, work, f"s{r}"))
        (a, a_cpu), (b, b_cpu) = ([statistics.median(column) for column in zip(*rates[e])] for e in ("plain", "spec"))
        s = spec.speculator
        table.row(name, f"{a:.0f}", f"{b:.0f}", f"{b / a:.2f}x", f"{b_cpu / a_cpu:.2f}x",
                  f"{s.num_accepted} / {s.num_proposed}")  # fmt: skip


if __name__ == "__main__":
    main()
