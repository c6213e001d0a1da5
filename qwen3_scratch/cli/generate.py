"""`python -m qwen3_scratch.generate` (or `qwen3-generate`): argparse -> Pipeline -> print.

Text streams to stdout as it is generated; the stats line goes to stderr. Bad input of any kind
(a missing folder, a corrupt shard, an impossible flag, no network) is one line on stderr and
exit code 2, never a traceback; Ctrl-C exits 130 without one, even while torch is being imported.

Nothing heavy is imported at the top: torch loads inside `run_cli`'s Ctrl-C handling, and `--help`
is instant. Every flag is checked before the model loads (or downloads).
"""

import argparse
import atexit
import sys

from qwen3_scratch.errors import InputError
from qwen3_scratch.text.limits import DEFAULT_BATCH_SIZE, MAX_PROMPT_BYTES

from .flags import (
    OneLineParser,
    VersionAction,
    check_quantize_flags,
    exit_without_teardown,
    loading,
    model_flags,
    params_from_args,
    quantize_flags,
    quantize_notice,
    run_cli,
    sampling_flags,
    speculative_args,
    speculative_flags,
)
from .inputs import MAX_INPUT_BYTES, read_prompts, stdin_waiting

PROG = "qwen3-generate"

EXAMPLES = f"""\
examples:
  {PROG} --prompt "Explain KV cache in one sentence."
  echo "Why is the sky blue?" | {PROG} --temperature 0 --no-thinking
  {PROG} --model weights/tiny-qwen3 --prompt "Hi" --max-new-tokens 24 --seed 3 --show-stats
  {PROG} --prompts-file prompts.txt --batch-size 16 --max-new-tokens 128
  {PROG} --model Qwen/Qwen3-8B --speculative draft --draft-model Qwen/Qwen3-0.6B --prompt "Hi" --show-stats

limits: one prompt is at most {MAX_PROMPT_BYTES // 2**20} MiB of UTF-8, stdin or a prompts file at most \
{MAX_INPUT_BYTES // 2**20} MiB.
exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted (Ctrl-C).
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Generate text with Qwen3, from scratch in PyTorch.", epilog=EXAMPLES,
                      formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--version", action=VersionAction)
    model_flags(p)
    p.add_argument("--prompt", action="append", help="the prompt; repeat it to run a batch (default: stdin)")
    p.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line, run --batch-size at a time (default: none)")
    p.add_argument("--batch-size", type=int,
                   help=f"prompts generated together; results print as each batch ends (default {DEFAULT_BATCH_SIZE}; "
                   "1 with --speculative)")  # fmt: skip
    p.add_argument("--system", help="a system message (needs the chat template; default: none)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the checkpoint's chat template (default: on)")  # fmt: skip
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="let Qwen3 think before answering, in chat mode (default: on)")  # fmt: skip
    sampling_flags(p)
    quantize_flags(p)
    p.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="decode with the KV cache; --no-kv-cache recomputes everything each step (default: on)")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (inductor's fused kernels, as CUDA graphs; GPU only); the first "
                   "start pays the compile, later ones load it from ~/.cache/qwen3-scratch/inductor (default: off)")  # fmt: skip
    p.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs", action="store_false", default=None,
                   help="run each decode step op by op instead of replaying it from a CUDA graph, for debugging "
                   "(default: graphs on a GPU)")  # fmt: skip
    speculative_flags(p)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens, for benchmarks (default: off)")
    p.add_argument("--show-stats", action="store_true", help="print a key=value stats line to stderr (default: off)")
    p.add_argument("--hide-thinking", action="store_true", help="do not print the reasoning (one prompt; default: off)")
    p.add_argument("--tools", help="a JSON file with a list of tool schemas; calls print as JSON lines (one prompt; default: none)")
    return p


def check_template_flags(args) -> None:
    """--system and --thinking only mean something inside the chat template: refuse them without it."""
    if not args.chat and args.system is not None:
        raise InputError("--system needs the chat template: drop --no-chat, or write the system turn into the prompt")
    if not args.chat and args.thinking is not None:
        raise InputError("--thinking/--no-thinking need the chat template: drop --no-chat or that flag")


def run(args) -> None:
    check_template_flags(args)
    check_quantize_flags(args)
    if args.batch_size is None:
        args.batch_size = 1 if args.speculative else DEFAULT_BATCH_SIZE
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    prompts = read_prompts(args.prompt, args.prompts_file, sys.stdin)  # before torch: bad input fails fast
    if args.speculative and args.batch_size > 1 and len(prompts) > 1:
        raise InputError("--speculative runs one prompt at a time: drop --batch-size or make it 1")
    if (args.prompt or args.prompts_file) and stdin_waiting(sys.stdin):
        print(f"{PROG}: warning: ignoring stdin, the prompt comes from --prompt/--prompts-file", file=sys.stderr)
    tools = check_reply_flags(args, prompts)
    with loading():
        params = params_from_args(args)
        from qwen3_scratch.generation.pipeline import Pipeline

        pipe = Pipeline.load(args.model, args.weights_dir, args.local_files_only, args.device, args.dtype,
                             revision=args.revision, verify=args.verify, quantize=args.quantize,
                             quantize_group_size=args.quantize_group_size, use_cache=args.kv_cache,
                             compile=args.compile, cuda_graphs=args.cuda_graphs, measure_bandwidth=args.show_stats,
                             tensor_parallel_size=args.tensor_parallel_size, **speculative_args(args))  # fmt: skip
    if notice := quantize_notice(args.quantize, pipe.model.device.type, args.compile):
        print(f"{PROG}: {notice}", file=sys.stderr)
    from qwen3_scratch.kernels.aot_build import start_background_build

    start_background_build()  # the kernels inductor built while loading, packaged for later starts
    pipe.tokenizer.store_table()  # bpe.py's table of tokenizer.json, if it has none: later starts skip the parse
    atexit.register(start_background_build)  # and those the first prompt of a size built (int4.py's blocks)
    template = dict(system=args.system, chat=args.chat, thinking=args.thinking is not False)
    if args.hide_thinking or tools is not None:  # the parsed reply: reasoning apart, tool calls
        print_reply(pipe, prompts[0], params, args, tools)
        report(pipe, args, f" reasoning_tokens={pipe.conversation.last_stats.reasoning_tokens}")
        return
    if len(prompts) == 1:
        for piece in pipe.stream(prompts[0], params, **template):
            print(piece, end="", flush=True)
        print()
        report(pipe, args, f" reasoning_tokens={reasoning_tokens(pipe)}")
        return
    done = 0
    for texts in pipe.generate_batches(prompts, params, args.batch_size, **template):
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
    from .chat import read_tools

    flag = "--tools" if args.tools is not None else "--hide-thinking" if args.hide_thinking else None
    if flag and (not args.chat or len(prompts) > 1):
        raise InputError(f"{flag} needs one prompt in chat mode (drop --no-chat, or pass a single --prompt)")
    return read_tools(args.tools) if args.tools is not None else None


def print_reply(pipe, prompt, params, args, tools) -> None:
    """The reply as typed pieces: reasoning apart (or hidden), the answer, each tool call as a JSON line."""
    from .chat import ReplyPrinter

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
    printer = ReplyPrinter(sys.stdout, args.hide_thinking)
    for delta in pipe.chat_stream(messages, params, tools, args.thinking is not False):
        printer.show(delta)
    printer.end()


def reasoning_tokens(pipe) -> int:
    """How many of the tokens pipe.stream just generated went to reasoning."""
    from qwen3_scratch.generation.conversation import count_reasoning_tokens

    return count_reasoning_tokens(pipe.tokenizer, pipe.last_prompt_ids, pipe.last_ids)


def main(argv=None) -> int:
    return run_cli(PROG, build_parser(), run, argv)


def entry() -> None:
    """The `qwen3-generate` command (and `python -m qwen3_scratch.generate`): main, then a quick exit."""
    exit_without_teardown(main())
