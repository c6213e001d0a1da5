"""`python -m qwen3_scratch.chat` in a real pseudo-terminal (pexpect) and with piped stdin.

Every answer the terminal shows is checked against the Python API: the test runs the same turns through
Pipeline.chat_stream in-process (same seed, same order of calls, so the same cache reuse) and renders them
with the same ReplyPrinter, then expects exactly that text from the child process.
"""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch.cli.chat import ReplyPrinter
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = ["--temperature", "1.0", "--seed", "3", "--ignore-eos"]
SHORT = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "tiny-qwen3")


@pytest.fixture
def pipe(tiny):  # a fresh pipeline (and cache) per test, loaded as the chat command loads it (same dtype, layout)
    return Pipeline.load(str(tiny), device="cpu")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def rendered(pipe, messages, request, thinking=True, terminal=True) -> str:
    """What the chat command prints for this turn; appends the reply to `messages`."""
    out = Terminal() if terminal else io.StringIO()
    printer = ReplyPrinter(out)
    for delta in pipe.chat_stream(messages, request, thinking=thinking):
        printer.show(delta)
    printer.end()
    messages.append(pipe.conversation.last_message)
    return out.getvalue()


def on_tty(text: str) -> str:
    return text.replace("\n", "\r\n")  # the terminal's output processing (onlcr)


def spawn(tiny, *flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb", "PYTHONIOENCODING": "utf-8"}
    child = pexpect.spawn(sys.executable, ["-m", "qwen3_scratch.chat", "--model", str(tiny), *SAMPLING, *flags],
                          env=env, encoding="utf-8", codec_errors="replace", timeout=60, dimensions=(24, 500))  # fmt: skip
    child.expect_exact("/help lists the commands")
    child.expect_exact(">>> ")
    return child


def turn(child, line, expected=None):
    child.sendline(line)
    child.expect_exact(line + "\r\n")  # the terminal's echo
    if expected is not None:
        child.expect_exact(on_tty(expected))
        child.expect_exact(">>> ")


def test_two_turns_no_think_reset_and_ctrl_d_in_a_terminal(tiny, pipe, tmp_path):
    child = spawn(tiny, "--max-new-tokens", "10")
    messages = [{"role": "user", "content": "Hello there"}]
    turn(child, "Hello there", rendered(pipe, messages, SHORT))
    messages.append({"role": "user", "content": "How are you?"})
    turn(child, "How are you?", rendered(pipe, messages, SHORT))

    turn(child, "/no_think", "thinking off\n")
    messages.append({"role": "user", "content": "Answer briefly /no_think"})  # the soft switch joins the message
    no_think = rendered(pipe, messages, SHORT, thinking=False)
    turn(child, "Answer briefly", no_think)
    saved = tmp_path / "chat.json"
    turn(child, f"/save {saved}", f"saved 6 messages to {saved}\n")
    assert json.loads(saved.read_text()) == messages

    turn(child, "/reset", "new conversation\n")
    # a new conversation (the thinking switch is a setting, like the system message: it stays off)
    fresh = [{"role": "user", "content": "Hello there"}]
    turn(child, "Hello there", rendered(pipe, fresh, SHORT, thinking=False))

    child.sendeof()  # Ctrl-D at the prompt
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def stats(child) -> dict:
    child.sendline("/stats")
    child.expect(r"prompt_tokens=.*thinking=\w+")
    return dict(pair.split("=", 1) for pair in child.after.split())


def test_ctrl_c_stops_the_answer_keeps_it_and_the_session_goes_on(tiny, pipe, tmp_path):
    child = spawn(tiny, "--max-new-tokens", "2000")  # an answer far longer than the test waits
    turn(child, "Tell me a long story")
    child.expect(r"\S")  # the answer has begun
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect_exact(">>> ")
    first = stats(child)
    generated = int(first["generated_tokens"])
    assert 0 < generated < 2000, f"Ctrl-C must stop the answer mid-way, got {generated} tokens"

    turn(child, "Go on")  # a further turn, in the same session, reusing the cache
    child.expect(r"\S")
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect_exact(">>> ")
    # All of turn 1's prompt at least: its reply is reused too only if the part kept re-renders as generated (a
    # reply cut after a whitespace-only first piece, this seed's "\x0b", is stripped by the template to "").
    assert int(stats(child)["reused_tokens"]) >= int(first["prompt_tokens"]), "turn 2 must reuse turn 1's cache"
    saved = tmp_path / "cut.json"
    turn(child, f"/save {saved}", f"saved 4 messages to {saved}\n")
    child.sendeof()
    child.expect(pexpect.EOF)

    # What was kept is exactly the first `generated` tokens' reply, as the API gives it for that length.
    conversation = json.loads(saved.read_text())
    cut = SamplingParams(max_tokens=generated, temperature=1.0, seed=3, ignore_eos=True)
    assert pipe.chat(conversation[:1], cut) == conversation[1]


def test_piped_stdin_is_one_turn_per_line_and_a_bad_file_is_one_line(tiny, pipe, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    script = f"Hello there\n/no_think\nAnswer briefly\n/bogus\n/load {bad}\n/load {tmp_path / 'none.json'}\n/help\n"
    result = subprocess.run(
        [sys.executable, "-m", "qwen3_scratch.chat", "--model", str(tiny), *SAMPLING, "--max-new-tokens", "10"],
        input=script, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    messages = [{"role": "user", "content": "Hello there"}]
    expected = rendered(pipe, messages, SHORT, terminal=False) + "thinking off\n"
    messages.append({"role": "user", "content": "Answer briefly /no_think"})
    expected += rendered(pipe, messages, SHORT, thinking=False, terminal=False)
    expected += "unknown command /bogus; /help lists the commands\n"
    assert result.stdout.startswith(expected), f"expected:\n{expected!r}\ngot:\n{result.stdout!r}"
    assert "\x1b[" not in result.stdout, "no terminal escapes when stdout is not a terminal"
    rest = result.stdout[len(expected) :].splitlines()
    assert re.fullmatch(r"error: /load .*bad\.json: not valid JSON \(.*\)", rest[0]), rest[0]
    assert re.fullmatch(r"error: /load .*none\.json: No such file or directory", rest[1]), rest[1]
    assert rest[2].startswith("/think, /no_think"), "the session goes on after a bad file"


@pytest.mark.parametrize("flags, needle", [(["--tools", "/no/such/tools.json"], "--tools"),
                                           (["--temperature", "-1"], "--temperature")])  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2_before_the_model_loads(tiny, capsys, flags, needle):
    from qwen3_scratch.cli.chat import main

    code = main(["--model", str(tiny), *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err
