"""`python -m qwen3_scratch.generate` (or `qwen3-generate`): argparse -> Pipeline -> print.

Text streams to stdout as it is generated; the stats line goes to stderr. Bad input of any kind
(a missing folder, a corrupt shard, an impossible flag, no network) is one line on stderr and
exit code 2, never a traceback; Ctrl-C exits 130 without one, even while torch is being imported.

Nothing heavy is imported at the top: torch loads inside `run_cli`'s Ctrl-C handling, and `--help`
is instant. Every flag is checked before the model loads (or downloads). The other commands reuse
the pieces: `OneLineParser`, `model_flags(parser)`, `sampling_flags(parser)`,
`request_from_args(args)` (checks the sampling and length flags), `inputs.read_prompts` and
`run_cli(prog, parser, body)`.
"""

import argparse
import sys

from . import __version__
from .errors import InputError, Qwen3Error, printable
from .inputs import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MODEL,
    DTYPE_NAMES,
    MAX_INPUT_BYTES,
    MAX_PROMPT_BYTES,
    read_prompts,
    stdin_waiting,
)

PROG = "qwen3-generate"

EXAMPLES = f"""\
examples:
  {PROG} --prompt "Explain KV cache in one sentence."
  echo "Why is the sky blue?" | {PROG} --temperature 0 --no-thinking
  {PROG} --model weights/tiny-qwen3 --prompt "Hi" --max-new-tokens 24 --seed 3 --show-stats
  {PROG} --prompts-file prompts.txt --batch-size 16 --max-new-tokens 128

limits: one prompt is at most {MAX_PROMPT_BYTES // 2**20} MiB of UTF-8, stdin or a prompts file at most \
{MAX_INPUT_BYTES // 2**20} MiB.
exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted (Ctrl-C).
"""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def model_flags(p: argparse.ArgumentParser) -> None:
    """Which checkpoint, from where, on which device, in which dtype."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="a local checkpoint folder or a Hub id (default %(default)s)")
    p.add_argument("--weights-dir", default="weights", help="where Hub models are downloaded (default %(default)s)")
    p.add_argument("--local-files-only", action="store_true", help="never touch the network (default: off)")
    p.add_argument("--revision", help="the Hub branch, tag or commit to download (default: main)")
    p.add_argument("--verify", action="store_true",
                   help="hash every file again, compare with the Hub, re-fetch what differs (default: off)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is there, else cpu (default %(default)s)")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, metavar="{auto,bfloat16,float16,float32}",
                   help="also bf16, fp16/half, fp32/float; auto: bfloat16 on cuda, float32 on cpu (default %(default)s)")  # fmt: skip


def sampling_flags(p: argparse.ArgumentParser) -> None:
    """How many tokens and how they are drawn; None means the checkpoint's generation_config.json."""
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many tokens (default %(default)s)")
    p.add_argument("--temperature", type=float,
                   help="0 is greedy, else at least 1e-4 (default: generation_config.json, else 1)")  # fmt: skip
    p.add_argument("--top-k", type=int, help="keep the k likeliest tokens; 0 is off (default: generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, help="nucleus: keep the top tokens holding this probability, in (0, 1] "
                   "(default: generation_config.json, else 1)")  # fmt: skip
    p.add_argument("--min-p", type=float, help="drop tokens under min-p x the top token's probability, in [0, 1) "
                   "(default: generation_config.json, else 0)")  # fmt: skip
    p.add_argument("--seed", type=int, help="seed the sampler, 0 to 2**64 - 1, for repeatable text (default: random)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Generate text with Qwen3, from scratch in PyTorch.", epilog=EXAMPLES,
                      formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    model_flags(p)
    p.add_argument("--prompt", action="append", help="the prompt; repeat it to run a batch (default: stdin)")
    p.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line, run --batch-size at a time (default: none)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help="prompts generated together; results print as each batch ends (default %(default)s)")  # fmt: skip
    p.add_argument("--system", help="a system message (needs the chat template; default: none)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the checkpoint's chat template (default: on)")  # fmt: skip
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="let Qwen3 think before answering, in chat mode (default: on)")  # fmt: skip
    sampling_flags(p)
    p.add_argument("--quantize", choices=["int8"], help="int8 weights with per-row scales, computed at load (CPU and CUDA; default: off)")
    p.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="decode with the KV cache; --no-kv-cache recomputes everything each step (default: on)")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (CUDA graphs on GPU); the first step pays the compile time (default: off)")  # fmt: skip
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens, for benchmarks (default: off)")
    p.add_argument("--show-stats", action="store_true", help="print a key=value stats line to stderr (default: off)")
    p.add_argument("--hide-thinking", action="store_true", help="do not print the reasoning (one prompt; default: off)")
    p.add_argument("--tools", help="a JSON file with a list of tool schemas; calls print as JSON lines (one prompt; default: none)")
    return p


def request_from_args(args):
    """The GenerationRequest the flags ask for; raises on an impossible value, before anything loads."""
    from .pipeline import GenerationRequest  # imports torch

    return GenerationRequest(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed, use_cache=getattr(args, "kv_cache", True),
        ignore_eos=getattr(args, "ignore_eos", False), compile=getattr(args, "compile", False),
        measure_bandwidth=getattr(args, "show_stats", False),
    )  # fmt: skip


def check_template_flags(args) -> None:
    """--system and --thinking only mean something inside the chat template: refuse them without it."""
    if not args.chat and args.system is not None:
        raise InputError("--system needs the chat template: drop --no-chat, or write the system turn into the prompt")
    if not args.chat and args.thinking is not None:
        raise InputError("--thinking/--no-thinking need the chat template: drop --no-chat or that flag")


def run(args) -> None:
    check_template_flags(args)
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    prompts = read_prompts(args.prompt, args.prompts_file, sys.stdin)  # before torch: bad input fails fast
    if (args.prompt or args.prompts_file) and stdin_waiting(sys.stdin):
        print(f"{PROG}: warning: ignoring stdin, the prompt comes from --prompt/--prompts-file", file=sys.stderr)
    tools = check_reply_flags(args, prompts)
    request = request_from_args(args)
    from .pipeline import Pipeline

    pipe = Pipeline.load(args.model, args.weights_dir, args.local_files_only, args.device, args.dtype,
                         revision=args.revision, verify=args.verify, quantize=args.quantize)  # fmt: skip
    template = dict(system=args.system, chat=args.chat, thinking=args.thinking is not False)
    if args.hide_thinking or tools is not None:  # the parsed reply: reasoning apart, tool calls
        print_reply(pipe, prompts[0], request, args, tools)
        report(pipe, args, f" reasoning_tokens={pipe.conversation.last_stats.reasoning_tokens}")
        return
    if len(prompts) == 1:
        for piece in pipe.stream(prompts[0], request, **template):
            print(piece, end="", flush=True)
        print()
        report(pipe, args, f" reasoning_tokens={reasoning_tokens(pipe)}")
        return
    done = 0
    for texts in pipe.generate_batches(prompts, request, args.batch_size, **template):
        for text in texts:
            done += 1
            print(f"--- [{done}/{len(prompts)}] {prompts[done - 1][:60]!r}\n{text}", flush=True)
        report(pipe, args)


def report(pipe, args, extra: str = "") -> None:
    """After each generation (each batch): the context note and the stats line (+ extra), on stderr."""
    if pipe.last_stop_reason == "context":
        print(f"[stopped: reached the model's context of {pipe.model.config.max_position_embeddings} tokens]",
              file=sys.stderr)  # fmt: skip
    if args.show_stats:
        print(pipe.last_stats.line() + extra, file=sys.stderr)


def check_reply_flags(args, prompts) -> list[dict] | None:
    """--hide-thinking and --tools need the parsed reply: one prompt, in chat mode. Returns the tools."""
    from .chat_cli import read_tools

    flag = "--tools" if args.tools is not None else "--hide-thinking" if args.hide_thinking else None
    if flag and (not args.chat or len(prompts) > 1):
        raise InputError(f"{flag} needs one prompt in chat mode (drop --no-chat, or pass a single --prompt)")
    return read_tools(args.tools) if args.tools is not None else None


def print_reply(pipe, prompt, request, args, tools) -> None:
    """The reply as typed pieces: reasoning apart (or hidden), the answer, each tool call as a JSON line."""
    from .chat_cli import ReplyPrinter

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
    printer = ReplyPrinter(sys.stdout, args.hide_thinking)
    for delta in pipe.chat_stream(messages, request, tools, args.thinking is not False):
        printer.show(delta)
    printer.end()


def reasoning_tokens(pipe) -> int:
    """How many of the tokens pipe.stream just generated went to reasoning."""
    from .conversation import count_reasoning_tokens

    return count_reasoning_tokens(pipe.tokenizer, pipe.last_prompt_ids, pipe.last_ids)


def run_cli(prog: str, parser: argparse.ArgumentParser, body, argv=None) -> int:
    """Parse argv and run body(args): a Qwen3Error is one line and exit 2, Ctrl-C is exit 130, quietly."""
    try:
        body(parser.parse_args(argv))
    except Qwen3Error as e:
        print(f"{prog}: error: {printable(e, limit=2000)}", file=sys.stderr)  # one line, however it was built
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


def main(argv=None) -> int:
    return run_cli(PROG, build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
