"""`python -m qwen3_scratch.chat` (or `qwen3-chat`): a multi-turn conversation in the terminal.

argparse -> Pipeline -> a loop of turns over Pipeline.chat_stream, which keeps the KV cache between turns.
Reasoning streams apart from the answer: dimmed on a terminal, after a `[thinking]` marker in a pipe, or
not at all with --hide-thinking. When stdin is not a terminal, each line is one user turn (or command), so
a session can be scripted: `printf 'Hi\\n/stats\\n' | qwen3-chat --model ...`.

/think and /no_think are Qwen3's soft switches, and mean what they mean to Qwen3: the switch is appended to
the next user message (Qwen3 follows the latest switch in the history, and a saved conversation keeps it),
and the template's enable_thinking follows it too, so a model that ignores the text (any checkpoint not
trained on it) still answers without reasoning: enable_thinking=false writes the empty <think></think>.
"""

import argparse
import atexit
import json
import signal
import sys
import threading
from pathlib import Path

from qwen3_scratch.errors import InputError, Qwen3Error

from .flags import (
    OneLineParser,
    check_quantize_flags,
    exit_without_teardown,
    loading,
    model_flags,
    params_from_args,
    quantize_flags,
    run_cli,
    sampling_flags,
    speculative_args,
    speculative_flags,
)

PROG = "qwen3-chat"

DIM, PLAIN = "\x1b[2m", "\x1b[0m"
HELP = """\
/think, /no_think   Qwen3's soft switches: reason before answering (default), or answer directly
/system TEXT        set the system message (/system alone removes it)
/reset              start a new conversation (the system message stays)
/save FILE          write the conversation to FILE as JSON messages
/load FILE          continue a conversation written by /save
/stats              numbers about the last answer
/help               this list
/exit               quit (Ctrl-D too); Ctrl-C stops an answer and keeps what it said so far"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Chat with Qwen3 in the terminal (multi-turn, KV cache reused).")
    model_flags(p)  # the same model, quantization and sampling flags as qwen3-generate
    quantize_flags(p)
    sampling_flags(p)
    speculative_flags(p)
    p.set_defaults(max_new_tokens=1024)  # per answer: Qwen3 reasons at length before it answers
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens (tests, benchmarks)")
    p.add_argument("--system", help="the system message (default: none)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="let Qwen3 think first; /think and /no_think switch it (default: on)")  # fmt: skip
    p.add_argument("--hide-thinking", action="store_true", help="do not print the reasoning (default: off)")
    p.add_argument("--tools", help="a JSON file with a list of tool schemas the model may call (default: none)")
    return p


def read_tools(path: Path) -> list[dict]:
    """--tools FILE: a JSON list of tool schemas ({"type": "function", "function": {...}} or the bare function)."""
    tools = _read_json(path, "--tools")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InputError(f"--tools {path}: expected a JSON list of tool schemas (objects)")
    return tools


def read_messages(path: Path) -> list[dict]:
    """/load FILE: a JSON list of messages, each an object with a string role."""
    messages = _read_json(path, "/load")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):  # fmt: skip
        raise InputError(f"/load {path}: expected a JSON list of messages like {{\"role\": \"user\", \"content\": ...}}")
    return messages


def _read_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise InputError(f"{what} {path}: {error.strerror}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{what} {path}: not valid JSON ({error})") from error


class ReplyPrinter:
    """Writes an answer's pieces as they come: reasoning apart from the answer, each tool call as a JSON line."""

    def __init__(self, out, hide_thinking: bool = False):
        self.out, self.hide_thinking, self.tty = out, hide_thinking, out.isatty()
        self.section = None  # what was written last: "reasoning", "content" or "tool_call"

    def show(self, delta) -> None:
        if delta.kind == "reasoning" and self.hide_thinking:
            return
        self._enter(delta.kind)
        self.out.write(json.dumps(delta.tool_call, ensure_ascii=False) if delta.kind == "tool_call" else delta.text)
        self.out.flush()

    def _enter(self, section: str) -> None:
        if section == self.section and section != "tool_call":
            return
        self.end()
        if section == "reasoning":
            self.out.write(DIM if self.tty else "[thinking] ")
        self.section = section  # a tool call is a bare JSON line, so scripts can read it as it is

    def end(self) -> None:
        """Close the current section on its own line (and undo the dimming)."""
        if self.section == "reasoning" and self.tty:
            self.out.write(PLAIN)
        if self.section is not None:
            self.out.write("\n")
        self.section = None
        self.out.flush()


class ChatSession:
    """The conversation a terminal drives: the messages, the thinking switch, and the /commands."""

    def __init__(self, pipe, params, system=None, thinking=True,
                 hide_thinking=False, tools=None, out=sys.stdout):  # fmt: skip
        self.pipe, self.params, self.out = pipe, params, out
        self.system, self.thinking, self.hide_thinking, self.tools = system, thinking, hide_thinking, tools
        self.messages: list[dict] = []  # user and assistant turns; the system message is kept apart
        self.switch = None  # "/think" or "/no_think", to append to the next user message

    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def handle(self, line: str) -> bool:
        """One line of input: a command or a user turn. False means: end the session."""
        text = line.strip()
        if not text:
            return True
        name, _, argument = text.partition(" ")
        if name.startswith("/"):
            command = getattr(self, "do_" + name[1:], None)
            if command is None:
                self.say(f"unknown command {name}; /help lists the commands")
                return True
            return command(argument.strip()) is not False
        self.answer(text)
        return True

    def answer(self, text: str) -> None:
        if self.switch:
            text, self.switch = f"{text} {self.switch}", None
        self.messages.append({"role": "user", "content": text})
        printer = ReplyPrinter(self.out, self.hide_thinking)
        ctrl_c = CtrlC()
        # asked after every token, not only between pieces: a tool call's arguments show nothing until it closes
        stream = self.pipe.chat_stream(self.conversation(), self.params, self.tools, self.thinking,
                                       should_stop=lambda: ctrl_c.pressed)  # fmt: skip
        try:
            with ctrl_c:
                for delta in stream:
                    printer.show(delta)
                    if ctrl_c.pressed:
                        raise KeyboardInterrupt
                if ctrl_c.pressed:  # the stream ended at should_stop
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            stream.close()  # keeps the tokens so far as the reply, and the cache consistent
            printer.end()
            self.say("[interrupted]")
        except Qwen3Error as error:  # e.g. the conversation no longer fits the context
            self.messages.pop()
            printer.end()
            self.say(f"error: {error}")
            return
        printer.end()
        self.messages.append(self.pipe.conversation.last_message)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def do_think(self, _):
        self.thinking, self.switch = True, "/think"
        self.say("thinking on")

    def do_no_think(self, _):
        self.thinking, self.switch = False, "/no_think"
        self.say("thinking off")

    def do_system(self, text):
        self.system = text or None
        self.say(f"system message {'set' if text else 'removed'}")

    def do_reset(self, _):
        self.messages = []
        self.say("new conversation")

    def do_save(self, path):
        try:
            Path(path).write_text(json.dumps(self.conversation(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as error:
            return self.say(f"error: /save {path}: {error.strerror}")
        self.say(f"saved {len(self.conversation())} messages to {path}")

    def do_load(self, path):
        try:
            messages = read_messages(Path(path))
        except Qwen3Error as error:
            return self.say(f"error: {error}")
        has_system = bool(messages) and messages[0]["role"] == "system"
        self.system = messages[0].get("content") if has_system else None
        self.messages = messages[1:] if has_system else messages
        self.say(f"loaded {len(messages)} messages from {path}")

    def do_stats(self, _):
        stats = self.pipe.conversation.last_stats
        mode = f"messages={len(self.conversation())} thinking={'on' if self.thinking else 'off'}"
        self.say(f"{stats.line()} {mode}" if stats else f"no answer yet; {mode}")

    def do_help(self, _):
        self.say(HELP)

    def do_exit(self, _):
        return False


class CtrlC:
    """Ctrl-C while an answer streams, noted and acted on between two tokens of the answer (the stream asks).

    A KeyboardInterrupt raised wherever the main thread happens to be could land inside the stream's
    bookkeeping of a token (counted but not yet parsed), and the reply kept would then not be the tokens
    generated. Noted here, the answer stops at a token boundary, where the stream's state is whole. A
    second Ctrl-C before the next token (a long prefill) interrupts at once, as usual."""

    def __enter__(self):
        self.pressed, self.previous = False, None
        # only the main thread may set handlers; an ignored SIGINT (a background job) stays ignored
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def read_lines(interactive: bool):
    """User input, line by line, until Ctrl-D or the end of the piped input. Ctrl-C at the prompt clears the line."""
    if interactive:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    while True:
        try:
            yield input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return
        except KeyboardInterrupt:
            print()


def run(args) -> None:
    check_quantize_flags(args)
    tools = read_tools(args.tools) if args.tools is not None else None
    with loading():
        params = params_from_args(args)  # impossible flags fail here, before the model loads
        from qwen3_scratch.generation.pipeline import Pipeline  # torch: imported inside run_cli's Ctrl-C handling

        pipe = Pipeline.load(args.model, args.weights_dir, args.local_files_only, args.device, args.dtype,
                             revision=args.revision, verify=args.verify, quantize=args.quantize,
                             quantize_group_size=args.quantize_group_size,
                             tensor_parallel_size=args.tensor_parallel_size, **speculative_args(args))  # fmt: skip
    from qwen3_scratch.kernels.aot_build import start_background_build

    start_background_build()  # the kernels inductor built while loading, packaged for later starts
    pipe.tokenizer.store_table()  # bpe.py's table of tokenizer.json, if it has none: later starts skip the parse
    atexit.register(start_background_build)  # and those the first prompt of a size built (int4.py's blocks)
    session = ChatSession(pipe, params, args.system, args.thinking, args.hide_thinking, tools)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"{PROG}: {pipe.checkpoint.name}. /help lists the commands; Ctrl-D quits.", flush=True)
    for line in read_lines(interactive):
        if not session.handle(line):
            return


def main(argv=None) -> int:
    return run_cli(PROG, build_parser(), run, argv)


def entry() -> None:
    """The `qwen3-chat` command (and `python -m qwen3_scratch.chat`): main, then a quick exit."""
    exit_without_teardown(main())
