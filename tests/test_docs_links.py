"""README.md, the guides in docs/ and the scripts' READMEs name only what exists: every script and file path,
every relative link (and its #anchor), and every `--flag` given to one of our commands or scripts.

A page is read as a reader reads it. Paths are taken from the repository root (`scripts/bench/soak.py`), links
from the page's own folder. A command is `python -m qwen3_scratch.<cmd>`, `qwen3-<cmd>` or `python scripts/....py`,
in a code block (backslash continuations joined) or inline code; its flags are the `--words` after it, up to a
pipe, `;`, `&&`, a comment or the next command. Our commands' flags come from their own `--help`; a script's from
the `add_argument` calls in its source, read with `ast` (no torch import per script).
"""

import argparse
import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").rglob("README.md"))]
COMMANDS = ("generate", "chat", "serve")

# A path from the root: a script or anything it reads, a module, a test, a guide, the notebook. Not inside another
# path (`$tree/scripts/x.py`, `/tmp/scripts/x.py`) and not a bare word.
PATH = re.compile(r"(?<![\w/.$-])((?:scripts|qwen3_scratch|tests|notebooks|docs)/[\w./-]*\w)")
CHECKED_SUFFIXES = {".py", ".md", ".ipynb", ".jinja", ".json", ".png"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"(?:python3? )?-m qwen3_scratch\.(\w+)|\bqwen3-(generate|chat|serve)\b|python3? (\S*scripts/\S+\.py)")
FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")
END_OF_COMMAND = re.compile(r"\||;|&&|\s#")


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def code_texts(text: str) -> list[str]:
    """Each line of every fenced block (continuations joined), then every inline code span outside them."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return lines + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


@functools.cache
def cli_flags(command: str) -> frozenset[str]:
    """Every option `python -m qwen3_scratch.<command> --help` lists."""
    done = subprocess.run([sys.executable, "-m", f"qwen3_scratch.{command}", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert done.returncode == 0, f"qwen3_scratch.{command} --help failed:\n{done.stderr}"
    return frozenset(FLAG.findall(done.stdout))


@functools.cache
def script_flags(path: Path) -> frozenset[str]:
    """The options a script's argparse parser takes, read from its `add_argument` calls (and --help)."""
    flags = {"--help"}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        # a script that wraps one of our commands (`from qwen3_scratch.cli.serve import main`) takes its flags too
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qwen3_scratch.cli."):
            if node.module.rsplit(".", 1)[1] in COMMANDS and any(a.name == "main" for a in node.names):
                flags.update(cli_flags(node.module.rsplit(".", 1)[1]))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            flags.update(names)
            if any(isinstance(k.value, ast.Attribute) and k.value.attr == "BooleanOptionalAction" for k in node.keywords):
                flags.update("--no-" + name[2:] for name in names)
    return frozenset(flags)


def flags_of(match: re.Match) -> tuple[str, frozenset[str]] | None:
    """(what the command is called, the flags it takes) for a command found in a page; None for one not ours."""
    module, entry, script = match.groups()
    if script:
        path = ROOT / script[script.index("scripts/"):]
        return (script, script_flags(path)) if path.exists() else None  # a missing script is reported as a path
    command = module or entry
    return (f"qwen3_scratch.{command}", cli_flags(command)) if command in COMMANDS else None


def broken_paths(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    found = {m[1].rstrip(".") for m in PATH.finditer(text)}
    return [f"{page_name(page)}: {path} does not exist" for path in sorted(found)
            if Path(path).suffix in CHECKED_SUFFIXES or path.startswith("scripts/")
            if not (ROOT / path).exists()]  # fmt: skip


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            problems.append(f"{page_name(page)}: link ({target}) points to a missing file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{page_name(page)}: link ({target}) names no heading of {resolved.relative_to(ROOT)}")
    return problems


def broken_flags(page: Path) -> list[str]:
    problems = set()
    for text in code_texts(page.read_text(encoding="utf-8")):
        starts = list(COMMAND.finditer(text))
        for i, match in enumerate(starts):
            known = flags_of(match)
            if known is None:
                continue
            name, flags = known
            rest = text[match.end() : starts[i + 1].start() if i + 1 < len(starts) else len(text)]
            rest = END_OF_COMMAND.split(rest, maxsplit=1)[0]
            problems.update(f"{page_name(page)}: {name} has no flag {flag}" for flag in FLAG.findall(rest)
                            if flag not in flags)  # fmt: skip
    return sorted(problems)


def test_the_checks_find_a_missing_script_a_dead_link_and_an_unknown_flag(tmp_path, monkeypatch):
    """Each check must be able to fail: a page naming things that do not exist."""
    page = ROOT / "docs" / "a-page-for-this-test.md"
    page.write_text("# Title\n\nRun `python scripts/bench/no_such_script.py`, see [x](missing.md) and [y](#nowhere):\n"
                    "```bash\npython scripts/checkpoints/make_tiny_checkpoint.py --no-such-flag --out x \\\n"
                    "    --moe | python -m qwen3_scratch.generate --prompt hi --max-tokens 3\n```\n")  # fmt: skip
    try:
        assert broken_paths(page) == ["docs/a-page-for-this-test.md: scripts/bench/no_such_script.py does not exist"]
        assert broken_links(page) == [
            "docs/a-page-for-this-test.md: link (missing.md) points to a missing file",
            "docs/a-page-for-this-test.md: link (#nowhere) names no heading of docs/a-page-for-this-test.md",
        ]
        assert broken_flags(page) == [
            "docs/a-page-for-this-test.md: qwen3_scratch.generate has no flag --max-tokens",
            "docs/a-page-for-this-test.md: scripts/checkpoints/make_tiny_checkpoint.py has no flag --no-such-flag",
        ]
    finally:
        page.unlink()


def test_the_flag_reader_sees_what_argparse_sees():
    """script_flags reads add_argument calls: the same set a real parser built from them accepts."""
    path = ROOT / "scripts" / "checkpoints" / "make_shape_checkpoint.py"
    flags = script_flags(path)
    assert {"--size", "--out", "--force"} <= flags, flags
    parser = argparse.ArgumentParser()
    parser.add_argument("--x", action=argparse.BooleanOptionalAction)
    assert "--no-x" in parser.format_help()


@pytest.mark.parametrize("check", [broken_paths, broken_links, broken_flags], ids=lambda c: c.__name__)
def test_every_page_names_only_what_exists(check):
    problems = [problem for page in PAGES for problem in check(page)]
    assert not problems, f"{len(problems)} broken references (fix the page, or the script it names):\n" + "\n".join(problems)


def test_readme_links_every_guide_and_stays_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(readme)}
    unlinked = [page_name(page) for page in sorted((ROOT / "docs").glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md does not link these guides (one click from the front page): {unlinked}"
    lines = readme.count("\n")
    assert lines <= 200, f"README.md is {lines} lines: a front page stays under 200; move the detail to a guide"
