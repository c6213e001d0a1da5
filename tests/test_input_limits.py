"""Hostile input ends fast, in one line: oversized prompts, endless files, bytes that are not UTF-8,
batches of thousands, and logits that stop being numbers."""

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import GenerationError, InputError
from qwen3_scratch.cli import inputs
from qwen3_scratch.cli.generate import main
from qwen3_scratch.cli.inputs import read_prompts, read_prompts_file
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.sampling.logits import NON_FINITE, LogitsFilter, sample
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.limits import MAX_PROMPT_BYTES, count_tokens_upto

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("limits") / "tiny-qwen3")


@pytest.fixture(scope="module")
def pipe(tiny):
    return Pipeline.load(str(tiny), device="cpu")


def run_cli_process(*args, stdin=subprocess.DEVNULL, memory_gib=3, timeout=120):
    """The real command in a fresh process, under an address-space limit and a timeout."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory_gib << 30, memory_gib << 30))

    return subprocess.run(
        [sys.executable, "-m", "qwen3_scratch.generate", *map(str, args)], stdin=stdin, capture_output=True,
        preexec_fn=limit, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def assert_one_line(err: str, *needles):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, f"expected one error line, got:\n{err}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from: {lines[0]}"


# --- bounded reading -------------------------------------------------------------------------------


def test_an_endless_prompts_file_stops_at_the_per_prompt_limit(tiny):
    result = run_cli_process("--model", tiny, "--prompts-file", "/dev/zero")
    assert result.returncode == 2
    assert_one_line(result.stderr.decode(), "--prompts-file /dev/zero", "line 1", f"{MAX_PROMPT_BYTES:,} bytes")


def test_a_100_mb_prompt_on_stdin_is_refused_after_reading_the_limit(tiny, tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 100 MB of NUL bytes without writing them
        f.truncate(100 * 2**20)
    with open(big, "rb") as stdin:
        result = run_cli_process("--model", tiny, stdin=stdin)
    assert result.returncode == 2
    assert_one_line(result.stderr.decode(), "stdin", "more than", "limit for one prompt")


def test_a_100_mb_prompt_through_the_api_is_refused_before_the_tokenizer(tiny):
    """In-process API: no reading limit applies, so the context's byte bound must catch it."""
    code = (
        "import sys\n"
        "from qwen3_scratch import GenerationError\n"
        "from qwen3_scratch.generation.pipeline import Pipeline\n"
        f"pipe = Pipeline.load({str(tiny)!r}, device='cpu')\n"
        "pipe.tokenizer.encode = None  # any tokenizer call would now fail loudly\n"
        "try:\n"
        "    list(pipe.stream('word ' * 20_000_000))\n"
        "except GenerationError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "100,000,000 characters" in result.stdout and "shorten the prompt" in result.stdout, result.stdout


@pytest.mark.parametrize("repeats, message, most", [
    (24_000, "1,056,000 characters, more than the model's context of 2048 tokens can hold", 0),  # ~1 MB
    (1_300, "is at least .* tokens but the model's context is 2048", 16 * 2048),  # 57 KB, ~13k tokens
])  # fmt: skip
def test_a_long_prompt_is_refused_before_it_is_tokenized_whole(pipe, monkeypatch, repeats, message, most):
    """Against a 2048-token context: over 32 bytes a token, nothing is tokenized; under, only a prefix."""
    seen = [0]
    encode = pipe.tokenizer.encode
    monkeypatch.setattr(pipe.tokenizer, "encode", lambda text: seen.append(len(text)) or encode(text))
    prompt = "the quick brown fox jumps over the lazy dog " * repeats
    with pytest.raises(GenerationError, match=message + ".*shorten the prompt"):
        pipe.prompt_ids(prompt, chat=False)
    assert max(seen) <= most, f"tokenized {max(seen):,} characters of a {len(prompt):,}-character prompt"


@pytest.mark.parametrize("text", ["short text", "a b " * 3000, "longwordwithoutspaces" * 1000, "😀 中文 " * 2000])
def test_counting_up_to_a_limit_equals_the_real_count_or_proves_it_is_over(pipe, text):
    encode = pipe.tokenizer.encode
    full = len(encode(text))
    for limit in (10, 100, 1000, 10_000):
        counted = count_tokens_upto(encode, text, limit)
        if full <= limit:
            assert counted == full
        else:
            assert limit < counted <= full, f"limit {limit}: counted {counted}, really {full}"


def test_a_prompt_within_the_context_still_runs(pipe):
    ids = pipe.prompt_ids("fox " * 1500, chat=False)  # over 2048 characters but fewer tokens than the context
    assert len(ids) < 2048
    assert len(pipe.generate(["fox " * 1500], GREEDY, chat=False)) == 1


def test_a_prompts_file_over_the_total_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "MAX_INPUT_BYTES", 1000)
    file = tmp_path / "many.txt"
    file.write_text("a prompt of some length\n" * 100)
    with pytest.raises(InputError, match="more than 1,000 bytes of prompts; split the file"):
        read_prompts_file(file)


@pytest.mark.parametrize(
    "data, line, offset, byte",
    [
        (b"fine\nbad \xff here\n", 2, 9, "0xff"),  # a byte that is never UTF-8
        (b"\xc0\xaf slash\n", 1, 0, "0xc0"),  # an overlong encoding of '/'
        (b"ok\n\n\xed\xa0\x80 surrogate\n", 3, 4, "0xed"),  # an encoded UTF-16 surrogate
        (b"line one\r\ntruncated \xe4\xb8", 2, 20, "0xe4"),  # a character cut at the end of the file
        (b"latin-1 caf\xe9\n", 1, 11, "0xe9"),  # a file saved as Latin-1
    ],
)
def test_prompts_file_that_is_not_utf8_names_line_and_byte(tmp_path, data, line, offset, byte):
    file = tmp_path / "prompts.txt"
    file.write_bytes(data)
    with pytest.raises(InputError) as error:
        read_prompts_file(file)
    assert f"line {line}, byte {offset} ({byte}) is not UTF-8" in str(error.value)


def test_stdin_that_is_not_utf8_is_a_one_line_error(tiny, tmp_path):
    (tmp_path / "in.txt").write_bytes("naïve".encode() + b" \xfe")
    with open(tmp_path / "in.txt", "rb") as stdin:
        result = run_cli_process("--model", tiny, stdin=stdin)
    assert result.returncode == 2
    assert_one_line(result.stderr.decode(), "stdin: byte 7 (0xfe) is not UTF-8")


def test_prompt_argument_that_is_not_utf8_is_a_one_line_error(tiny):
    argv = [sys.executable.encode(), b"-m", b"qwen3_scratch.generate", b"--model", bytes(tiny), b"--prompt", b"ab\xffc"]
    result = subprocess.run(argv, capture_output=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert_one_line(result.stderr.decode(), "--prompt: byte 2 is not UTF-8")


@pytest.mark.parametrize("make", ["folder", "missing"])
def test_prompts_file_that_is_not_a_file(tmp_path, make):
    path = tmp_path / "p"
    if make == "folder":
        path.mkdir()
    with pytest.raises(InputError, match=r"--prompts-file .*p: (is a folder|No such file)"):
        read_prompts(prompts_file=path)


def test_api_prompt_with_a_lone_surrogate_is_an_input_error(pipe):
    with pytest.raises(InputError, match="the prompt: byte 3 is not UTF-8"):
        pipe.prompt_ids("abc\udcff" + "x" * 3000, chat=False)


# --- batches ---------------------------------------------------------------------------------------


def test_ten_thousand_prompts_run_batch_size_at_a_time(pipe, monkeypatch):
    from qwen3_scratch.generation import pipeline

    widths = []
    real = pipeline.generate_tokens
    monkeypatch.setattr(pipeline, "generate_tokens", lambda model, prompts, *a, **k: widths.append(len(prompts)) or real(model, prompts, *a, **k))  # fmt: skip
    prompts = [["the", "fox", "dog", "cat"][i % 4] for i in range(10_000)]  # short: the batching is on trial
    request = SamplingParams(max_tokens=1, temperature=0)
    batches = pipe.generate_batches(prompts, request, batch_size=2500, chat=False)
    first = next(batches)
    assert widths == [2500], "the first batch's results must come before the next batch runs"
    texts = first + [text for batch in batches for text in batch]
    assert len(texts) == 10_000 and widths == [2500] * 4, "every batch at most --batch-size rows: a bounded KV cache"
    alone = pipe.generate([prompts[1234]], request, chat=False)[0]
    assert texts[1234] == alone, "a prompt's text must not depend on the batch it ran in"


def test_cli_prints_each_batch_with_its_stats_line(tiny, tmp_path, capsys):
    file = tmp_path / "prompts.txt"
    file.write_text("".join(f"prompt {i}\n" for i in range(5)))
    code = main(["--model", str(tiny), "--prompts-file", str(file), "--batch-size", "2", "--max-new-tokens", "2",
                 "--temperature", "0", "--show-stats", "--no-thinking"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines() if line.startswith("---")] == [f"[{i}/5]" for i in range(1, 6)]
    stats = [line for line in err.splitlines() if line.startswith("prompt_tokens=")]
    assert len(stats) == 3, f"one stats line per batch of 2, 2 and 1 prompts, got:\n{err}"


# --- logits that are not numbers -----------------------------------------------------------------


@pytest.mark.parametrize("params", [LogitsFilter(temperature=0), LogitsFilter(), LogitsFilter(0.7, 5, 0.9, 0.05)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_sample_marks_rows_whose_logits_are_not_finite(params, bad):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = bad
    logits[3] = bad  # a whole row
    tokens = sample(logits, params, torch.Generator().manual_seed(0))
    assert tokens[1] == NON_FINITE and tokens[3] == NON_FINITE
    assert tokens[0] >= 0 and tokens[2] >= 0, "finite rows must still get a token"


def test_logits_that_overflow_under_temperature_are_marked_not_sampled():
    logits = torch.tensor([[3.0e38, 1.0, -3.0e38]])  # finite, but / 0.5 overflows float32
    assert sample(logits, LogitsFilter(temperature=0.5)).item() == NON_FINITE


def damaged(pipe, at_call: int, rows=None):
    """A forward hook that turns lm_head's output into NaN from its at_call-th call on."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) >= at_call:
            output = output.clone()
            output[rows if rows is not None else slice(None)] = float("nan")
        return output

    return pipe.model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "recompute"])
@pytest.mark.parametrize("temperature", [0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("at_call", [1, 4], ids=["prefill", "fourth_step"])
def test_non_finite_logits_stop_generation_with_one_clear_error(pipe, use_cache, temperature, at_call):
    handle = damaged(pipe, at_call)
    request = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True, seed=0)
    pipe.use_cache = use_cache
    try:
        with pytest.raises(GenerationError, match=f"stopped at generated token {at_call} .*NaN or inf"):
            list(pipe.stream("Hello", request))
    finally:
        handle.remove()
        pipe.use_cache = True


def test_one_bad_row_in_a_batch_is_named(pipe):
    handle = damaged(pipe, 2, rows=1)
    try:
        with pytest.raises(GenerationError, match=r"generated token 2 \(batch row 2\)"):
            pipe.generate(["first", "second", "third"], GREEDY)
    finally:
        handle.remove()


def test_the_token_loop_survives_a_caller_that_ignores_the_marker(pipe):
    """generate_tokens never feeds NON_FINITE back into the embedding (an IndexError; on a GPU an assert)."""
    handle = damaged(pipe, 2)
    try:
        steps = [t.tolist() for t in generate_tokens(pipe.model, [[1, 2, 3]], 5, ignore_eos=True)]
    finally:
        handle.remove()
    assert steps[0][0] >= 0 and all(step == [NON_FINITE] for step in steps[1:])


def test_cli_stops_on_non_finite_logits_with_one_line(tiny, capsys, monkeypatch):
    load = Pipeline.load.__func__

    def load_damaged(cls, *args, **kwargs):
        pipe = load(cls, *args, **kwargs)
        damaged(pipe, 3)
        return pipe

    monkeypatch.setattr(Pipeline, "load", classmethod(load_damaged))
    code = main(["--model", str(tiny), "--prompt", "Hi", "--max-new-tokens", "10", "--ignore-eos"])
    err = capsys.readouterr().err
    assert code == 2
    assert_one_line(err, "qwen3-generate: error: stopped at generated token 3", "--dtype float32")
