"""What the three commands share: argparse that fails in one line, the model and sampling flags, and
the Ctrl-C and error handling around a command's body.

    parser = OneLineParser(prog="qwen3-x"); model_flags(parser); sampling_flags(parser)
    return run_cli("qwen3-x", parser, body)      # body(args): Qwen3Error -> one line, exit 2; Ctrl-C -> 130

Every flag maps to one library parameter: `model_flags` and `quantize_flags` to `Pipeline.load` / `LLM`, `sampling_flags` to
`SamplingParams` (`params_from_args`, which checks each value by the same table as the library,
`sampling.params.FIELD_CHECKS`, but names the flag). Nothing heavy is imported here, so `--help` is
instant and every flag is checked before torch loads.
"""

import argparse
import atexit
import contextlib
import gc
import os
import sys

from qwen3_scratch.checkpoint.placement import DEFAULT_MODEL, DEVICE_HELP, DTYPE_HELP, DTYPE_NAMES
from qwen3_scratch.errors import InputError, Qwen3Error, printable

# SamplingParams field -> the flag that sets it, so an error names what the user typed
FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
         "seed": "--seed", "max_tokens": "--max-new-tokens", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "repetition_penalty": "--repetition-penalty",
         "min_tokens": "--min-tokens", "bad_words": "--bad-word", "logit_bias": "--logit-bias"}  # fmt: skip


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class VersionAction(argparse.Action):
    """--version: the installed version, looked up only when asked (qwen3_scratch.__version__ says why)."""

    def __init__(self, option_strings, dest, help="show program's version number and exit"):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from qwen3_scratch import __version__

        print(f"{parser.prog} {__version__}")  # on stdout, as argparse's own version action
        parser.exit()


def model_flags(p: argparse.ArgumentParser) -> None:
    """Which checkpoint, from where, on which device, in which dtype."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="a local checkpoint folder or a Hub id (default %(default)s)")
    p.add_argument("--weights-dir", default="weights", help="where Hub models are downloaded (default %(default)s)")
    p.add_argument("--local-files-only", action="store_true", help="never touch the network (default: off)")
    p.add_argument("--revision", help="the Hub branch, tag or commit to download (default: main)")
    p.add_argument("--verify", action="store_true",
                   help="hash every file again, compare with the Hub, re-fetch what differs (default: off)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=f"{DEVICE_HELP} (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, metavar="{auto,bfloat16,float16,float32}",
                   help=f"{DTYPE_HELP} (default %(default)s)")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=at_least_one, default=1, metavar="N",
                   help="split the model over N processes (one per GPU; on a CPU they share its cores), e.g. 8 for "
                        "Qwen3-235B-A22B on 8 GPUs (default %(default)s)")  # fmt: skip


def at_least_one(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its one-line error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def quantize_flags(p: argparse.ArgumentParser) -> None:
    """Weights quantized at load (kernels/quantize.py, kernels/int4.py); nothing is written to disk."""
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="int8: one scale per row; int4: a scale and zero point per group of weights; computed at "
                   "load (default: off)")  # fmt: skip
    p.add_argument("--quantize-group-size", type=int, choices=[32, 64, 128],
                   help="int4 only: weights per scale and zero point (default: 32, as llama.cpp's Q4_0)")  # fmt: skip


def check_quantize_flags(args) -> None:
    """--quantize-group-size without --quantize int4 is refused before anything loads."""
    if args.quantize_group_size is not None and args.quantize != "int4":
        raise InputError("--quantize-group-size applies to --quantize int4 only: add --quantize int4 or drop it")


def quantize_notice(quantize: str | None, device_type: str, compiled: bool) -> str | None:
    """A line for stderr when the flags ask for a slow combination: int8 on a GPU without --compile. Its one-row
    products then run one compiled kernel each (kernels/quantize.py, "row-kernel"), which an H100 ran at 8B at
    132.9 tok/s, below bf16's 141.4; `--compile` reached 192.5 (docs/performance.md)."""
    if quantize == "int8" and device_type == "cuda" and not compiled:
        return ("note: int8 on a GPU is faster than bf16 only with --compile (an H100 at 8B: 192.5 tok/s compiled, "
                "132.9 without, bf16 141.4)")
    return None


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
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="minus this for every token already generated, -2 to 2 (default %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="minus this times each token's count so far, -2 to 2 (default %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="prompt and output tokens divided (or times) by this; 1 is off (default %(default)s)")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many tokens (default %(default)s)")
    p.add_argument("--bad-word", action="append", default=[], metavar="WORD",
                   help="never generate this word (repeatable; default: none)")  # fmt: skip
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100 to 100) to token ID's logit (repeatable; default: none)")  # fmt: skip


def speculative_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, one prompt at a time: who proposes tokens, and at most how many a round."""
    p.add_argument("--speculative", choices=["ngram", "draft"],
                   help="check several proposed tokens per forward, output unchanged: ngram proposes what followed "
                   "the last tokens earlier in the prompt or answer; draft asks --draft-model (default: off)")  # fmt: skip
    p.add_argument("--draft-model", help="for --speculative draft: a smaller Qwen3 with the same tokenizer, a folder or "
                   "a Hub id (e.g. Qwen/Qwen3-0.6B for Qwen3-8B; default: none)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, help="the most tokens proposed per round, 1 to 15; fewer "
                   "while proposals are not being kept (default: 4)")  # fmt: skip


def speculative_args(args) -> dict:
    """The speculative flags as Pipeline.load's keyword arguments."""
    return dict(speculative=args.speculative, draft_model=args.draft_model,
                num_speculative_tokens=args.num_speculative_tokens)  # fmt: skip


def params_from_args(args):
    """The SamplingParams the flags ask for (unset ones: the checkpoint's defaults, filled at generation);
    raises naming the flag for an impossible value, before anything loads."""
    from qwen3_scratch.sampling.params import SamplingParams, check_fields  # imports torch

    given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 seed=args.seed, max_tokens=args.max_new_tokens, presence_penalty=args.presence_penalty,
                 frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                 min_tokens=args.min_tokens, bad_words=args.bad_word or None,
                 logit_bias=parse_logit_bias(args.logit_bias) or None)  # fmt: skip
    check_fields(given, FLAGS)
    return SamplingParams(**given, ignore_eos=getattr(args, "ignore_eos", False))


def parse_logit_bias(items: list[str]) -> dict:
    """["100=-100", ...] -> {100: -100.0}; a malformed item is one line naming the flag."""
    bias = {}
    for item in items:
        token, _, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise Qwen3Error(f"--logit-bias must be ID=BIAS (e.g. 100=-100), got {printable(repr(item), 80)}") from None
    return bias


@contextlib.contextmanager
def loading():
    """Around a command's imports and model load: Python's cycle collector off, then on again.

    torch's import and the model's ~600 modules make ~300k objects that live as long as the process; the
    collector walked them in 3 full collections and many young ones, ~0.15 s of CPU of a ~2 s start
    (docs/performance.md, "Cold start: second start"). What the load leaves as cyclic garbage (a first
    start's inductor compiles) is collected as usual once the collector is back; nothing is frozen."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_cli(prog: str, parser: argparse.ArgumentParser, body, argv=None) -> int:
    """Parse argv and run body(args): a Qwen3Error is one line and exit 2, Ctrl-C is exit 130, quietly.
    body may return an exit status of its own (the server's, when its engine died)."""
    try:
        status = body(parser.parse_args(argv))
    except Qwen3Error as e:
        print(f"{prog}: error: {printable(e, limit=2000)}", file=sys.stderr)  # one line, however it was built
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()
    return status or 0


def _reader_gone() -> int:
    """The reader of stdout went away (`qwen3-generate ... | head`): stop quietly with the status a Unix tool
    killed by SIGPIPE has. stdout is pointed at /dev/null first, so flushing what Python still buffers for it
    at exit cannot raise a second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13  # SIGPIPE


def exit_without_teardown(status: int):
    """End a finished command the way the OS would free it, skipping Python's teardown.

    After the last token, the interpreter spent 0.1-0.2 s freeing torch's objects and ~1500 modules one
    by one (docs/performance.md, "Cold start: second start"); the OS takes that memory back at once. The
    atexit handlers still run (the tensor-parallel group's close, torch's own) and the output is flushed,
    so only the freeing is skipped. For the entry points only: main(argv) returns, for callers in Python.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing left to write to
            pass
    os._exit(status)
