"""The command line: streams text, prints honest stats, and turns every bad input into one line + exit 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from cli_helpers import assert_one_line_error, cli
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch.checkpoint.placement import pick_dtype
from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

STATS_KEYS = [
    "prompt_tokens", "generated_tokens", "elapsed_seconds", "tokens_per_second", "ttft_seconds",
    "decode_tokens_per_second", "device", "dtype", "peak_memory_mb", "bandwidth_util", "reasoning_tokens",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny-qwen3")


def test_greedy_cli_output_equals_the_python_api(tiny, capsys):
    code, out, err = cli(capsys, "--model", tiny, "--prompt", "Hello there", "--temperature", "0",
                         "--max-new-tokens", "20")  # fmt: skip
    assert code == 0, err
    pipe = Pipeline.load(tiny, local_files_only=True)  # the same defaults (dtype, layout) as the CLI
    expected = pipe.generate(["Hello there"], SamplingParams(max_tokens=20, temperature=0))[0]
    assert out == expected + "\n"


def test_stats_line_goes_to_stderr_as_key_value_pairs(tiny, capsys):
    code, out, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "8", "--ignore-eos",
                         "--show-stats", "--seed", "1")  # fmt: skip
    assert code == 0
    pairs = dict(item.split("=", 1) for item in err.strip().splitlines()[-1].split())
    assert list(pairs) == STATS_KEYS
    assert pairs["generated_tokens"] == "8", "--ignore-eos must generate exactly --max-new-tokens"
    assert pairs["device"] == "cpu" and pairs["dtype"] == pick_dtype("auto", "cpu")
    assert float(pairs["tokens_per_second"]) > 0 and 0 < float(pairs["bandwidth_util"]) < 10


def test_kv_cache_and_recompute_print_the_same_greedy_text(tiny, capsys):
    base = ["--model", tiny, "--prompt", "Tell me", "--temperature", "0", "--max-new-tokens", "16"]
    _, cached, _ = cli(capsys, *base)
    _, recomputed, _ = cli(capsys, *base, "--no-kv-cache")
    assert cached == recomputed


def test_thinking_flag_changes_the_prompt_as_qwen3_does(tiny, capsys):
    """--no-thinking appends Qwen3's empty <think></think> block, so the model sees 4 more tokens or so."""
    base = ["--model", tiny, "--prompt", "Hi", "--max-new-tokens", "1", "--show-stats", "--temperature", "0"]
    _, _, thinking = cli(capsys, *base)
    _, _, no_thinking = cli(capsys, *base, "--no-thinking")

    def prompt_tokens(err):
        return int(err.split("prompt_tokens=")[1].split()[0])

    assert prompt_tokens(no_thinking) > prompt_tokens(thinking)


def test_same_seed_same_text(tiny, capsys):
    base = ["--model", tiny, "--prompt", "Once", "--temperature", "1.0", "--max-new-tokens", "16"]
    assert cli(capsys, *base, "--seed", "3")[1] == cli(capsys, *base, "--seed", "3")[1]


def test_batch_of_prompts_equals_each_prompt_alone(tiny, capsys, tmp_path):
    prompts = ["first prompt", "a second, longer prompt than the first one"]
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(prompts) + "\n\n")
    code, out, _ = cli(capsys, "--model", tiny, "--prompts-file", file, "--temperature", "0", "--max-new-tokens", "12")
    assert code == 0
    for prompt in prompts:
        _, alone, _ = cli(capsys, "--model", tiny, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12")
        assert alone.rstrip("\n") in out, f"batched output for {prompt!r} differs from running it alone"


def test_raw_prompt_without_chat_template(tiny, capsys):
    base = ["--model", tiny, "--prompt", "abc", "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos"]
    code, raw, _ = cli(capsys, *base, "--no-chat")
    assert code == 0
    pipe = Pipeline(load_model(tiny), Tokenizer.from_checkpoint(tiny), tiny)
    request = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert raw == "".join(pipe.stream("abc", request, chat=False)) + "\n"
    assert raw != cli(capsys, *base)[1], "with the chat template the model sees a different prompt"


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--temperature", "-1"], ["--temperature"]),
        (["--top-p", "1.5"], ["--top-p"]),
        (["--top-p", "0"], ["--top-p"]),
        (["--top-k", "-3"], ["--top-k"]),
        (["--min-p", "2"], ["--min-p"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--temperature", "hot"], ["--temperature"]),
    ],
)
def test_impossible_settings_are_one_line_errors(tiny, capsys, flags, needles):
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "x", *flags)
    assert_one_line_error(code, err, *needles)


def test_missing_folder_is_a_one_line_error(capsys, tmp_path):
    code, _, err = cli(capsys, "--model", tmp_path / "nope", "--prompt", "x")
    assert_one_line_error(code, err, "nope")


def test_corrupt_shard_is_a_one_line_error(tiny, capsys, tmp_path):
    broken = shutil.copytree(tiny, tmp_path / "broken")
    shard = sorted(broken.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    code, _, err = cli(capsys, "--model", broken, "--prompt", "x")
    assert_one_line_error(code, err, shard.name, "truncated")


def test_prompt_longer_than_the_context_is_a_one_line_error(tiny, capsys):
    context = json.loads((tiny / "config.json").read_text())["max_position_embeddings"]
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "word " * (context + 10), "--no-chat")
    assert_one_line_error(code, err, "context", "shorten the prompt")


def test_no_network_is_a_one_line_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    code, _, err = cli(capsys, "--model", "Qwen/Qwen3-0.6B", "--weights-dir", tmp_path, "--prompt", "x")
    assert_one_line_error(code, err, "Qwen/Qwen3-0.6B")


def test_local_files_only_never_downloads(capsys, tmp_path):
    code, _, err = cli(capsys, "--model", "Qwen/Qwen3-0.6B", "--weights-dir", tmp_path, "--local-files-only",
                       "--prompt", "x")  # fmt: skip
    assert_one_line_error(code, err, "Qwen/Qwen3-0.6B", "--local-files-only")


def test_no_prompt_is_a_one_line_error(tiny, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    code, _, err = cli(capsys, "--model", tiny)
    assert_one_line_error(code, err, "--prompt")


def test_module_entry_point_streams_from_stdin(tiny):
    """The real command, as a user types it: `python -m qwen3_scratch.generate`, prompt on stdin."""
    result = subprocess.run(
        [sys.executable, "-m", "qwen3_scratch.generate", "--model", str(tiny), "--max-new-tokens", "5",
         "--temperature", "0", "--show-stats"],
        input="Hello from stdin", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "generated_tokens=" in result.stderr
    assert result.stdout.endswith("\n")


def test_a_reader_that_stops_early_ends_the_command_quietly(tiny):
    """`qwen3-generate ... | head -c 1`: the closed pipe ends the command with SIGPIPE's status, no traceback."""
    command = [sys.executable, "-m", "qwen3_scratch.generate", "--model", str(tiny), "--max-new-tokens", "300",
               "--temperature", "0", "--ignore-eos", "--prompt", "Hi"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        process.stdout.read(1)
        process.stdout.close()  # the reader is gone; the command's next write meets a closed pipe
        stderr = process.stderr.read().decode()
        status = process.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert status == 141, f"exit status {status}, stderr: {stderr[-500:]}"


def test_hub_id_is_downloaded_into_weights_dir_then_generates(tiny, capsys, tmp_path, monkeypatch):
    """The main path end to end: `--model org/name` downloads (from a fake Hub here), verifies, generates."""
    from fake_hub import make_hf_hermetic, serve_fake_hub
    from huggingface_hub import constants

    make_hf_hermetic(tmp_path, monkeypatch)
    weights = tmp_path / "weights"
    args = ["--model", "fake-org/tiny-qwen3", "--weights-dir", weights, "--prompt", "Hi", "--temperature", "0",
            "--max-new-tokens", "8"]  # fmt: skip
    with serve_fake_hub({"fake-org/tiny-qwen3": tiny}) as hub:
        # what HF_ENDPOINT=<url> sets when huggingface_hub is imported
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        code, downloaded, err = cli(capsys, *args)
        assert code == 0, err
        assert (weights / "tiny-qwen3" / "model.safetensors.index.json").exists()
        _, local, _ = cli(capsys, "--model", tiny, *args[2:])
        assert downloaded == local, "the downloaded copy must generate exactly what the source folder does"
    code, offline, err = cli(capsys, *args, "--local-files-only")  # the Hub is gone now
    assert code == 0, err
    assert offline == local


def test_a_mistyped_local_folder_says_so(capsys, tmp_path, monkeypatch):
    """`weights/tiny-qwen3x` is also a valid Hub id; when `weights/` exists here, the error says which folder is missing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights").mkdir()
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    code, _, err = cli(capsys, "--model", "weights/tiny-qwen3x", "--prompt", "x")
    assert_one_line_error(code, err, "no checkpoint folder at weights/tiny-qwen3x (looked for", "check the name")


def test_quantize_int8_generates_from_the_cli(tiny, capsys):
    code, out, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "6", "--ignore-eos",
                         "--temperature", "0", "--quantize", "int8", "--show-stats")  # fmt: skip
    assert code == 0, err
    pairs = dict(item.split("=", 1) for item in err.strip().splitlines()[-1].split())
    assert pairs["generated_tokens"] == "6" and pairs["dtype"] == "int8", "int8 must load and generate"


def test_int8_on_a_gpu_without_compile_gets_a_note_and_nothing_else_does(tiny, capsys):
    """The note names the slow combination (int8, a GPU, no --compile) and no other: on a CPU the int8 run above
    prints none."""
    from qwen3_scratch.cli.flags import quantize_notice

    assert "--compile" in quantize_notice("int8", "cuda", False)
    for quantize, device, compiled in (("int8", "cuda", True), ("int8", "cpu", False), ("int4", "cuda", False),
                                       (None, "cuda", False)):  # fmt: skip
        assert quantize_notice(quantize, device, compiled) is None, (quantize, device, compiled)
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "2", "--quantize", "int8")
    assert code == 0 and "note:" not in err, err


def test_compile_on_cpu_refuses_in_one_line(tiny, capsys):
    code, out, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--device", "cpu", "--compile")
    assert_one_line_error(code, err, "--compile", "drop --compile")
