"""`qwen3-generate` keeps reasoning apart: --hide-thinking, reasoning_tokens in the stats, --tools.

A random model almost never writes <think> itself, so these tests use a copy of the tiny checkpoint whose
template opens <think> in the generation prompt (as some Qwen3 templates do): everything the model then
writes is reasoning, until a </think> it never writes.
"""

import shutil

import pytest
from cli_helpers import cli
from make_tiny_checkpoint import CHAT_TEMPLATE_FILE, make_tiny_checkpoint

from qwen3_scratch.checkpoint.weights import load_model
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.sampling.params import SamplingParams
from qwen3_scratch.text.tokenizer import Tokenizer

NO_THINKING = "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
TOOL = {"type": "function", "function": {"name": "get_time", "description": "Time now in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("reasoning") / "tiny-qwen3")


@pytest.fixture(scope="module")
def thinking_tiny(tiny, tmp_path_factory):
    """The tiny checkpoint with a template whose generation prompt ends inside an open <think>."""
    folder = shutil.copytree(tiny, tmp_path_factory.mktemp("opens-think") / "tiny-qwen3")
    template = CHAT_TEMPLATE_FILE.read_text()
    assert NO_THINKING in template
    opened = template.replace(NO_THINKING, NO_THINKING + "    {%- else %}\n        {{- '<think>\\n' }}\n")
    (folder / "chat_template.jinja").write_text(opened)  # wins over tokenizer_config.json's copy
    return folder


def stat(err, key):
    return err.strip().splitlines()[-1].split(f"{key}=")[1].split()[0]


def test_hide_thinking_prints_only_the_answer_and_stats_count_the_reasoning(thinking_tiny, capsys):
    base = ["--model", thinking_tiny, "--prompt", "Hi", "--max-new-tokens", "12", "--seed", "1", "--ignore-eos",
            "--show-stats"]  # fmt: skip
    code, shown, err = cli(capsys, *base)
    assert code == 0, err
    assert shown.strip(), "without the flag the reasoning is printed"
    assert stat(err, "reasoning_tokens") == "12", "every token after the template's <think> is reasoning"
    code, hidden, err = cli(capsys, *base, "--hide-thinking")
    assert code == 0, err
    assert hidden == "", f"the reasoning must not be printed, got {hidden!r}"
    assert stat(err, "reasoning_tokens") == "12" and stat(err, "generated_tokens") == "12"


def test_answer_without_reasoning_counts_zero_reasoning_tokens(tiny, capsys):
    code, out, err = cli(capsys, "--model", tiny, "--prompt", "Hi", "--max-new-tokens", "6", "--seed", "1",
                         "--ignore-eos", "--show-stats", "--no-thinking", "--hide-thinking")  # fmt: skip
    assert code == 0, err
    assert stat(err, "reasoning_tokens") == "0"
    pipe = Pipeline(load_model(tiny), Tokenizer.from_checkpoint(tiny), tiny)
    request = SamplingParams(max_tokens=6, seed=1, ignore_eos=True)
    reply = pipe.chat([{"role": "user", "content": "Hi"}], request, thinking=False)
    assert out == reply["content"] + "\n", "--hide-thinking prints the answer of Pipeline.chat"


def test_tools_reach_the_prompt(tiny, capsys, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(f"[{__import__('json').dumps(TOOL)}]")
    base = ["--model", tiny, "--prompt", "What time is it in Paris?", "--max-new-tokens", "1", "--show-stats"]
    code, _, err = cli(capsys, *base, "--tools", tools)
    assert code == 0, err
    pipe = Pipeline(load_model(tiny), Tokenizer.from_checkpoint(tiny), tiny)
    expected = pipe.tokenizer.chat_ids([{"role": "user", "content": "What time is it in Paris?"}], tools=[TOOL])
    assert stat(err, "prompt_tokens") == str(len(expected)), "the tool schemas are in the prompt"
    assert int(stat(err, "prompt_tokens")) > int(stat(cli(capsys, *base)[2], "prompt_tokens"))


@pytest.mark.parametrize("content", ["{not json", '{"type": "function"}', "[1, 2]"])
def test_a_bad_tools_file_is_one_line_and_exit_2(tiny, capsys, tmp_path, content):
    tools = tmp_path / "tools.json"
    tools.write_text(content)
    code, _, err = cli(capsys, "--model", tiny, "--prompt", "x", "--tools", tools)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--tools" in err and "Traceback" not in err, err
