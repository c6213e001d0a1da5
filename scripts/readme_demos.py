"""Run every demo README.md and the guides in docs/ show, and write its real output back into that page, in place.

    python scripts/readme_demos.py                  # all demos (about a minute on 2 cores)
    python scripts/readme_demos.py chat-tool curl   # only these
    python scripts/readme_demos.py --list           # the demos and the pages they fill

Each demo owns one region of one page (README.md or a guide, `Demo.page`), between `<!-- demo: NAME -->` and
`<!-- /demo -->`: the command exactly as it runs here, then its output. Shell commands run through bash from the repository
root; Python snippets run as they are written, in a fresh interpreter; the server demos start
`python -m qwen3_scratch.serve` as docs/serving.md shows it and query it with curl and the real `openai` client.
Prose outside the regions is not touched, so it must not quote numbers an output could change; what
depends on the output (is the answer right?) is written inside the region, by `verdict`.

Needs weights/tiny-qwen3-trained (`python scripts/tiny/train_tiny.py`, a few minutes); makes the random
weights/tiny-qwen3 if it is missing (a second). A demo that fails stops the script and every page is left
as it was.
"""

import argparse
import ast
import json
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "tiny")]
from server_process import wait_for_health  # noqa: E402
from tiny_tasks import read_answer  # noqa: E402

TRAINED, RANDOM = "weights/tiny-qwen3-trained", "weights/tiny-qwen3"
PORT = 8000


def serve_command(port: int = PORT) -> str:
    return f"python -m qwen3_scratch.serve --model {TRAINED} --port {port}"


@dataclass
class Demo:
    name: str
    language: str  # "bash": run by bash; "python": run by a fresh interpreter
    code: str
    server: bool = False  # needs the server of serve_command() running
    runs: int = 1  # run this many times, show the last output (the prefix cache's second visit)
    expected: list[tuple[str, int]] = field(default_factory=list)  # (family, right answer) of each question asked
    answers: Callable[[str], list[str]] | None = None  # the output -> each answer's text, in the order asked
    page: str = "README.md"  # the page, from the repository root, that holds its region


def around_switch(output: str) -> list[str]:
    """chat-turns: the answer before the `thinking off` line, and the one after it."""
    lines = output.splitlines()
    switch = lines.index("thinking off")
    return [lines[switch - 1], lines[switch + 1]]


def demos(port: int = PORT) -> list[Demo]:
    """Every demo, in reading order (README, then the guides); port: where the server demos find the server (the
    pages': 8000)."""
    return [
        Demo(
            "chat-trained",
            "bash",
            f"printf 'What is 386 + 48?\\n' | python -m qwen3_scratch.chat --model {TRAINED} --temperature 0 \\\n"
            "    --max-new-tokens 200",
            expected=[("add", 434)],
            answers=lambda out: out.splitlines()[-1:],
        ),
        Demo(
            "generate-random",
            "bash",
            f'python -m qwen3_scratch.generate --model {RANDOM} --prompt "Explain KV cache in one sentence." \\\n'
            "    --max-new-tokens 24 --seed 3 --show-stats",
            page="docs/tiny-model.md",
        ),
        Demo(
            "chat-tool",
            "bash",
            f"printf 'What is 9082 * 37?\\n' | python -m qwen3_scratch.chat --model {TRAINED} --temperature 0 \\\n"
            "    --max-new-tokens 200 --tools scripts/tiny/calculator.json",
            page="docs/tiny-model.md",
        ),
        Demo(
            "chat-turns",
            "bash",
            "printf 'What is 93 - 27?\\n/no_think\\nWhat is 273 + 19?\\n/stats\\n' | \\\n"
            f"    python -m qwen3_scratch.chat --model {TRAINED} --temperature 0 --max-new-tokens 200",
            expected=[("subtract", 66), ("add", 292)],
            answers=around_switch,
            page="docs/chat.md",
        ),
        Demo(
            "pipeline-chat",
            "python",
            f'''\
from qwen3_scratch import Pipeline, SamplingParams

pipe = Pipeline.load("{TRAINED}")         # or "Qwen/Qwen3-0.6B"
params = SamplingParams(max_tokens=200, temperature=0)
messages = [{{"role": "user", "content": "What is 41 - 26?"}}]
reply = pipe.chat(messages, params)        # {{"role": "assistant", "content": ..., "reasoning_content": ...}}
print(reply)
messages += [reply, {{"role": "user", "content": "What is 158 + 53?"}}]
for piece in pipe.chat_stream(messages, params):           # Delta(kind="reasoning" | "content" | "tool_call", ...)
    if piece.kind == "content":                            # the answer only, as it streams
        print(piece.text, end="", flush=True)
print()
print(pipe.conversation.last_stats.line())                 # reused_tokens: what turn 2 did not prefill again
''',
            expected=[("subtract", 15), ("add", 211)],
            answers=lambda out: [ast.literal_eval(out.splitlines()[0])["content"], out.splitlines()[1]],
            page="docs/chat.md",
        ),
        Demo(
            "curl",
            "bash",
            f'''\
curl -s http://127.0.0.1:{port}/v1/chat/completions -H "Content-Type: application/json" -d '{{"model": "{TRAINED}",
  "messages": [{{"role": "user", "content": "What is 501 + 69?"}}], "temperature": 0, "max_tokens": 200}}' | python -m json.tool''',
            server=True,
            runs=2,
            expected=[("add", 570)],
            answers=lambda out: [json.loads(out)["choices"][0]["message"]["content"]],
            page="docs/serving.md",
        ),
        Demo(
            "openai-tool",
            "python",
            f'''\
import json
import sys

from openai import OpenAI

sys.path.insert(0, "scripts/tiny")
from tiny_tasks import CALCULATOR, calculate   # the tool the model was trained to call, and the tool itself

client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="unused")
messages = [{{"role": "user", "content": "What is 6723 * 98?"}}]
ask = dict(model="{TRAINED}", tools=[CALCULATOR], temperature=0, max_tokens=200)
reply = client.chat.completions.create(messages=messages, **ask).choices[0].message
print("reasoning: ", reply.reasoning_content)
call = reply.tool_calls[0]
print("tool call: ", call.function.name, call.function.arguments)
result = calculate(json.loads(call.function.arguments)["expression"])
messages += [{{"role": "assistant", "content": reply.content, "tool_calls": [call.model_dump()],
              "reasoning_content": reply.reasoning_content}},      # Qwen3's template shows it again after a tool call
             {{"role": "tool", "tool_call_id": call.id, "content": json.dumps({{"result": result}})}}]
final = client.chat.completions.create(messages=messages, **ask).choices[0].message
print("tool result:", result)
print("reasoning: ", final.reasoning_content)
print("answer:    ", final.content)
''',
            server=True,
            expected=[("tool", 6723 * 98)],
            answers=lambda out: out.splitlines()[-1:],
            page="docs/serving.md",
        ),
    ]


def run(demo: Demo, cwd: Path) -> str:
    """The demo's stdout then its stderr, as a reader's terminal would show them (trailing spaces cut)."""
    command = ["bash", "-c", demo.code] if demo.language == "bash" else [sys.executable, "-c", demo.code]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    for _ in range(demo.runs):
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"demo {demo.name} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    text = done.stdout + done.stderr
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def verdict(demo: Demo, output: str) -> str:
    """One sentence: whether each answer in the output is right. A page's prose must not guess it."""
    parts = []
    for (family, expected), text in zip(demo.expected, demo.answers(output), strict=True):
        got = read_answer(family, text)
        parts.append(f"right ({expected})" if got == expected else f"wrong (it says {got}; {expected} is right)")
    noun = "The answer is" if len(parts) == 1 else "The answers are, in order:"
    return f"{noun} {'; '.join(parts)}."


def render(demo: Demo, output: str) -> str:
    """The page's region: the command as it ran, its output, and the verdict when the demo asks a question."""
    parts = [f"```{demo.language}\n{demo.code.rstrip()}\n```", f"```\n{output}\n```"]
    if demo.expected:
        parts.append(verdict(demo, output))
    return "\n".join(parts)


# A region's body is everything up to its end marker, never reaching into the next region.
REGION = re.compile(r"(<!-- demo: (?P<name>[\w-]+) -->\n)(?P<body>(?:(?!<!-- demo: ).)*?)(<!-- /demo -->)", re.S)


def regions(readme: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in REGION.finditer(readme)}


def fill(readme: str, bodies: dict[str, str], page: str = "README.md") -> str:
    """The page with the named regions' bodies replaced; every other character kept."""
    missing = set(bodies) - set(regions(readme))
    if missing:
        raise KeyError(f"{page} has no region for {sorted(missing)}: add <!-- demo: NAME --> ... <!-- /demo -->")
    return REGION.sub(lambda m: m[1] + (bodies[m["name"]] + "\n" if m["name"] in bodies else m["body"]) + m[4], readme)


@contextmanager
def served(cwd: Path, port: int = PORT):
    """serve_command(port) running in the background until the block ends; waits for /health first."""
    with socket.socket() as probe:  # another server there would answer the demos in this one's place
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already in use: stop what listens there, then run this again")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    command = serve_command(port)
    server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        try:
            wait_for_health(server, f"http://127.0.0.1:{port}", timeout=300)
        except RuntimeError as error:
            raise RuntimeError(f"{command}: {error}") from None
        yield server
    finally:
        server.terminate()
        server.wait(timeout=60)


def outputs(chosen: list[Demo], cwd: Path, port: int = PORT) -> dict[str, str]:
    """{name: region body} for each demo, the server started once for the demos that need it."""
    bodies = {d.name: render(d, run(d, cwd)) for d in chosen if not d.server}
    on_server = [d for d in chosen if d.server]
    if on_server:
        with served(cwd, port):
            bodies.update({d.name: render(d, run(d, cwd)) for d in on_server})
    return bodies


def check_weights(cwd: Path) -> None:
    if not (cwd / TRAINED / "model.safetensors").exists():
        raise SystemExit(f"{TRAINED} is missing: train it first with `python scripts/tiny/train_tiny.py` (a few minutes)")
    if not (cwd / RANDOM / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "scripts/checkpoints/make_tiny_checkpoint.py"], cwd=cwd, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run the demos of README.md and docs/ and write their real output there.")
    p.add_argument("names", nargs="*", help="demos to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the demos and exit")
    args = p.parse_args(argv)
    every = demos()
    by_name = {d.name: d for d in every}
    if args.list:
        print("\n".join(f"{d.name:<16} {d.page:<20} {d.code.splitlines()[0]}" for d in every))
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        p.error(f"no demo named {unknown}; --list shows them")
    check_weights(ROOT)
    start = time.perf_counter()
    chosen = [by_name[n] for n in args.names] if args.names else every
    bodies = outputs(chosen, ROOT)
    pages = {d.page: {} for d in chosen}
    for demo in chosen:
        pages[demo.page][demo.name] = bodies[demo.name]
    filled = {page: fill((ROOT / page).read_text(encoding="utf-8"), own, page) for page, own in pages.items()}
    for page, text in filled.items():  # written only once every page has its regions: all or nothing
        (ROOT / page).write_text(text, encoding="utf-8")
    print(f"{len(bodies)} demo regions rewritten in {', '.join(pages)} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
