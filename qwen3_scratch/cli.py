"""`python -m qwen3_scratch.generate` (or `qwen3-generate`): argparse -> Pipeline -> print.

Text streams to stdout as it is generated; the stats line goes to stderr. Bad input of any kind
(a missing folder, a corrupt shard, an impossible flag, no network) is one line on stderr and
exit code 2, never a traceback.
"""

import argparse
import sys
from pathlib import Path

from .errors import Qwen3Error
from .pipeline import DEFAULT_MODEL, GenerationRequest, Pipeline


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="qwen3-generate", description="Generate text with Qwen3, from scratch in PyTorch.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a local checkpoint folder or a Hub id (default %(default)s)")
    p.add_argument("--weights-dir", default="weights", help="where Hub models are downloaded (default %(default)s)")
    p.add_argument("--local-files-only", action="store_true", help="never touch the network")
    p.add_argument("--prompt", action="append", help="the prompt; repeat it to run a batch (default: stdin)")
    p.add_argument("--prompts-file", type=Path, help="a file with one prompt per line, run as a batch")
    p.add_argument("--system", help="a system message (chat mode)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True, help="let Qwen3 think first")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, help="0 is greedy (default: generation_config.json)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--quantize", choices=["int8"], help="int8 weights with per-row scales, computed at load (CPU and CUDA)")
    p.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="decode with the KV cache (--no-kv-cache: recompute everything each step)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU); the first step pays the compile time")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens (benchmarks)")
    p.add_argument("--show-stats", action="store_true", help="print a key=value stats line to stderr")
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise Qwen3Error(f"--prompts-file {args.prompts_file}: {e.strerror}") from e
    if not prompts and not sys.stdin.isatty():
        prompts = [sys.stdin.read()]
    if not prompts or not all(p.strip() for p in prompts):
        raise Qwen3Error("no prompt: pass --prompt TEXT, --prompts-file FILE, or pipe text on stdin")
    return prompts


def run(args) -> None:
    prompts = read_prompts(args)
    pipe = Pipeline.load(args.model, args.weights_dir, args.local_files_only, args.device, args.dtype, args.quantize)
    request = GenerationRequest(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, use_cache=args.kv_cache,
        ignore_eos=args.ignore_eos, compile=args.compile, measure_bandwidth=args.show_stats,
    )  # fmt: skip
    template = dict(system=args.system, chat=args.chat, thinking=args.thinking)
    if len(prompts) == 1:
        for piece in pipe.stream(prompts[0], request, **template):
            print(piece, end="", flush=True)
        print()
    else:
        for i, text in enumerate(pipe.generate(prompts, request, **template)):
            print(f"--- [{i + 1}/{len(prompts)}] {prompts[i][:60]!r}\n{text}", flush=True)
    if pipe.last_stop_reason == "context":
        print(f"[stopped: reached the model's context of {pipe.model.config.max_position_embeddings} tokens]",
              file=sys.stderr)  # fmt: skip
    if args.show_stats:
        print(pipe.last_stats.line(), file=sys.stderr)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except Qwen3Error as e:
        print(f"qwen3-generate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
