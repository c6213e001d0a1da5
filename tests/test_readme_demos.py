"""scripts/readme_demos.py: README and the guides show the commands the script runs, and the script really runs them.

The outputs in README come from the default 5-minute checkpoint; here the demos run on the test session's
trained checkpoint (the `trained_tiny` fixture), so what is checked is that each command works and its
output parses as README's verdicts need, not what the model answers.
"""

import json
import os
import re
from pathlib import Path

import pytest
import readme_demos
from openai_server import free_port
from tiny_tasks import CALCULATOR, is_held_out

ROOT = Path(__file__).resolve().parents[1]


def test_every_demo_has_a_region_in_its_page_showing_exactly_the_command_it_runs():
    demos = readme_demos.demos()
    pages = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}  # fmt: skip
    shown = {(page, name) for page, text in pages.items() for name in readme_demos.regions(text)}
    assert shown == {(d.page, d.name) for d in demos}, "the pages' <!-- demo: NAME --> regions and the script's demos differ"
    for demo in demos:
        body = readme_demos.regions(pages[demo.page])[demo.name]
        assert body.startswith(f"```{demo.language}\n{demo.code.rstrip()}\n```\n```\n"), (
            f"{demo.page}'s region {demo.name} does not show the command the script runs: run scripts/readme_demos.py"
        )
    server_pages = {d.page for d in demos if d.server}
    for page in server_pages:
        assert readme_demos.serve_command() in pages[page], f"{page} should show the server command its demos start"


def test_fill_rewrites_only_the_regions_it_is_given():
    readme = "a\n<!-- demo: one -->\n<!-- /demo -->\nb\n<!-- demo: two -->\nkept\n<!-- /demo -->\nc"
    once = readme_demos.fill(readme, {"one": "new"})
    assert once == readme.replace("one -->\n", "one -->\nnew\n"), once
    assert readme_demos.fill(once, {"one": "newer"}) == readme.replace("one -->\n", "one -->\nnewer\n")
    with pytest.raises(KeyError, match="three"):
        readme_demos.fill(readme, {"three": "x"})


def test_every_question_the_demos_ask_is_held_out_from_training():
    """README says so: the demos show answers to questions the model never trained on."""
    code = "\n".join(d.code for d in readme_demos.demos())
    keys = [{"+": f"add {min(int(a), int(b))} {max(int(a), int(b))}", "-": f"subtract {a} {b}", "*": f"tool {a} * {b}"}[op]
            for a, op, b in re.findall(r"What is (\d+) ([-+*]) (\d+)\?", code)]  # fmt: skip
    keys += [f"convert {v} {big} {small}" for v, big, small in re.findall(r"Convert (\d+) (\w+) to (\w+)\.", code)]
    keys += [f"convert {v} {big} {small}" for small, v, big in re.findall(r"How many (\w+) are in (\d+) (\w+)\?", code)]
    assert len(keys) == 8, keys  # every question of the trained demos
    for key in keys:
        assert is_held_out(key), f"{key!r} is in the training split: pick a held-out question"


def test_calculator_json_is_the_schema_the_model_was_trained_with():
    assert json.loads((ROOT / "scripts" / "tiny" / "calculator.json").read_text()) == [CALCULATOR]


@pytest.fixture(scope="module")
def demo_root(trained_tiny, tmp_path_factory):
    """A folder laid out like the repository for the demos' relative paths: weights/ and scripts/."""
    root = tmp_path_factory.mktemp("readme-demos")
    (root / "weights").mkdir()
    os.symlink(trained_tiny, root / readme_demos.TRAINED)
    os.symlink(ROOT / "scripts", root / "scripts")
    return root


def test_the_trained_chat_demos_run_and_their_answers_are_read(demo_root):
    by_name = {d.name: d for d in readme_demos.demos()}
    bodies = readme_demos.outputs([by_name["chat-trained"], by_name["chat-turns"]], demo_root)
    assert "[thinking]" in bodies["chat-trained"], bodies["chat-trained"]
    assert "prompt_tokens=" in bodies["chat-turns"] and "thinking off" in bodies["chat-turns"], bodies["chat-turns"]
    for body in bodies.values():  # the verdict line, whatever the answer
        assert body.splitlines()[-1].startswith(("The answer is", "The answers are")), body


def test_the_server_demos_run_against_qwen3_serve_with_curl_and_the_openai_client(demo_root):
    """The curl request (sent twice) and the openai client's tool round trip, on a server the script starts."""
    port = free_port()
    by_name = {d.name: d for d in readme_demos.demos(port)}
    bodies = readme_demos.outputs([by_name["curl"], by_name["openai-tool"]], demo_root, port)
    response = json.loads(bodies["curl"].split("```\n")[2])
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the second run should hit the prefix cache"
    assert response["choices"][0]["message"]["reasoning_content"], response
    assert "tool call:  calculator" in bodies["openai-tool"] and "answer:" in bodies["openai-tool"], bodies["openai-tool"]
