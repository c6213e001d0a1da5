"""What a new user meets in the first hour: --help, --version, flags checked before any download,
README's Python snippet, Ctrl-C at any moment, flags that would be silently ignored, honest stats."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from cli_helpers import cli
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch.checkpoint.placement import pick_dtype
from qwen3_scratch.cli.generate import EXAMPLES, build_parser
from qwen3_scratch.cli.inputs import stdin_waiting
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.kernels import widen
from qwen3_scratch.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("first-hour") / "weights" / "tiny-qwen3")


def test_help_gives_every_flag_a_text_and_its_default():
    for action in build_parser()._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, f"{action.option_strings} has no help text"
        assert "default" in action.help, f"{action.option_strings}: help must say the default: {action.help!r}"


def test_help_examples_are_valid_command_lines():
    examples = [line.strip() for line in EXAMPLES.splitlines() if line.strip().startswith("qwen3-generate")]
    assert len(examples) >= 3
    for example in examples:
        command = shlex.split(example.split("|")[-1])
        build_parser().parse_args(command[1:])  # an invalid example exits 2 here


def test_version_is_the_package_version(capsys):
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out == f"qwen3-generate {version('qwen3-scratch')}\n"


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
        (["--max-new-tokens", "-5"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "1e-300"], "--temperature must be 0 (greedy) or a finite number >= 0.0001"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "nan"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--min-p", "1"], "--min-p"),
        (["--seed", "-1"], "--seed must be an integer from 0 to 2**64 - 1"),
        (["--seed", str(2**64)], "--seed"),
        (["--seed", str(2**70)], "--seed"),
        (["--seed", "1.5"], "--seed"),
        (["--batch-size", "0"], "--batch-size"),
        (["--dtype", "fp8"], "--dtype"),
        (["--device", "tpu"], "--device"),
        (["--system", "be brief", "--no-chat"], "--system needs the chat template"),
        (["--no-thinking", "--no-chat"], "--thinking/--no-thinking need the chat template"),
    ],
)
def test_flags_are_checked_before_the_model_loads(capsys, tmp_path, monkeypatch, flags, needle):
    """With the default model and no network, the flag's problem is what the user sees."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(Pipeline, "load", lambda *a, **k: pytest.fail("the model loaded before the flags were checked"))
    code, _, err = cli(capsys, "--weights-dir", tmp_path, "--prompt", "x", *flags)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("alias, dtype", [("half", "float16"), ("fp16", "float16"), ("float", "float32"),
                                          ("fp32", "float32"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16")])  # fmt: skip
def test_dtype_aliases_name_torch_dtypes(alias, dtype):
    assert pick_dtype(alias, "cpu") == dtype


def test_auto_dtype_is_bf16_with_quantized_weights_on_any_cpu(tiny):
    """With int8 or int4 weights every product is torch's int kernel, fast with bf16 rows and 5-13x slower with fp32
    ones on a CPU without native bf16 (docs/performance.md): auto picks bf16 there too, and the Pipeline loads so."""
    for layout in ("decode", "batch"):
        assert pick_dtype("auto", "cpu", "int8", layout) == pick_dtype("auto", "cpu", "int4", layout) == "bfloat16"
    assert pick_dtype("fp32", "cpu", "int8") == "float32", "a dtype the user names is kept"
    pipe = Pipeline.load(tiny, quantize="int4", quantize_group_size=32)
    assert pipe.model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("native", [False, True])
def test_auto_dtype_is_fp32_only_for_an_engine_of_many_rows_on_a_cpu_without_bf16(tiny, native, monkeypatch):
    """One conversation's layout reads bf16 in its compiled loops and widens prompts to fp32 (kernels/widen.py):
    faster than fp32 on any CPU (a Zen 3: decode 9.6 against 6.2 tok/s, half the memory). An engine of many rows
    is faster in fp32 where the CPU has no bf16 instructions (oneDNN packs fp32 only). Both CPUs pretended here,
    through the Python APIs' own loads."""
    monkeypatch.setattr(widen, "cpu_has_native_bf16", lambda: native)
    assert pick_dtype("auto", "cpu") == pick_dtype("auto", "cpu", None, "decode") == "bfloat16"
    assert pick_dtype("auto", "cpu", None, "batch") == ("bfloat16" if native else "float32")
    assert pick_dtype("auto", "cuda", None, "batch") == "bfloat16"
    assert pick_dtype("float32", "cpu", None, "decode") == "float32", "a dtype the user names is kept"
    assert Pipeline.load(tiny).model.model.embed_tokens.weight.dtype == torch.bfloat16
    many, own = LLM(tiny, num_blocks=16, block_size=8), LLM(tiny, num_blocks=16, block_size=8, max_num_seqs=1)
    assert many.model.model.embed_tokens.weight.dtype == (torch.bfloat16 if native else torch.float32)
    assert own.model.model.embed_tokens.weight.dtype == torch.bfloat16, "a person's own server: one-row layout"


def test_dtype_alias_on_the_command_line_loads_that_dtype(tiny, capsys):
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "1", "--dtype", "bf16", "--show-stats")
    assert code == 0, err
    assert "dtype=bfloat16" in err


def test_stdin_given_with_a_prompt_is_named_in_one_warning_and_left_unread(tiny, capsys, monkeypatch):
    read_end, write_end = os.pipe()
    os.write(write_end, b"text the user piped in\n")
    with os.fdopen(read_end, "rb") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        code, out, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "2")
        assert code == 0, err
        assert err.splitlines()[0] == "qwen3-generate: warning: ignoring stdin, the prompt comes from --prompt/--prompts-file"
        os.close(write_end)
        assert stdin.read() == b"text the user piped in\n", "checking stdin must not consume it (shell loops read it next)"


@pytest.mark.parametrize("kind", ["devnull", "empty_pipe", "read_file"])
def test_stdin_without_waiting_bytes_gives_no_warning(tmp_path, kind):
    if kind == "devnull":
        stream = open(os.devnull, "rb")
    elif kind == "empty_pipe":
        read_end, _write_end = os.pipe()  # a writer that has not written (yet) is not "stdin given"
        stream = os.fdopen(read_end, "rb")
    else:
        (tmp_path / "f").write_bytes(b"abc")
        stream = open(tmp_path / "f", "rb")
        stream.read()
    with stream:
        assert not stdin_waiting(stream)


def test_decode_speed_counts_only_rows_still_running(tiny, monkeypatch):
    """Row 1 stops on EOS early, row 2 runs all 12 steps: decode tokens are (stop - 1) + 11, not 11 x 2."""
    pipe = Pipeline.load(str(tiny), device="cpu")
    batch = [pipe.prompt_ids("first prompt"), pipe.prompt_ids("the second prompt")]
    # sampled with a seed: the same draws whichever rows are still running, so row 2 is the same both times
    free = SamplingParams(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, seed=5, ignore_eos=True)
    rows = list(zip(*pipe.stream_ids(batch, free)))
    eos = next(t for t in rows[0][1:] if t not in rows[1] and rows[0].count(t) == 1)
    stop_at = rows[0].index(eos) + 1
    monkeypatch.setitem(pipe.generation_config, "eos_token_id", [eos])
    list(pipe.stream_ids(batch, SamplingParams(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, seed=5)))
    stats = pipe.last_stats
    assert stats.generated_tokens == stop_at + 12 and stats.decode_steps == 11
    assert stats.decode_tokens == stats.generated_tokens - 2
    assert stats.decode_tokens_per_second == pytest.approx(stats.decode_tokens / stats.decode_seconds)


def test_importing_the_package_and_the_cli_does_not_import_torch():
    code = "import sys, qwen3_scratch, qwen3_scratch.cli.generate, qwen3_scratch.cli.inputs; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "False", "torch must load inside main(), where Ctrl-C is handled"


def test_ctrl_c_while_torch_imports_exits_130_without_a_traceback(tiny):
    child = subprocess.Popen(
        [sys.executable, "-m", "qwen3_scratch.generate", "--model", str(tiny), "--prompt", "Hi",
         "--max-new-tokens", "200", "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    maps = Path(f"/proc/{child.pid}/maps")
    while "libtorch" not in maps.read_text() and time.monotonic() < deadline:  # torch's import has begun
        time.sleep(0.002)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()


def readme_python_snippet() -> str:
    """The first Python block of docs/generate.md's Python API section (README links there)."""
    readme = (ROOT / "docs" / "generate.md").read_text()
    section = readme.split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_snippet_runs_as_written_on_a_cpu(tiny):
    """In a folder holding weights/tiny-qwen3, as `python scripts/checkpoints/make_tiny_checkpoint.py` leaves it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", readme_python_snippet()], capture_output=True, text=True,
                            timeout=120, cwd=tiny.parent.parent, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "prompt_tokens=" in result.stdout
