"""EleutherAI's lm-eval against qwen3-serve, and the same tasks through lm-eval's `hf` model: same numbers?

    python scripts/bench/lm_eval_compare.py --model weights/tiny-qwen3          # writes docs/benchmarks/lm_eval_compare.json

Two small local tasks (their data is written here, no download):
  - `qwen3_mc`, a log-likelihood task (multiple choice): lm-eval's `local-completions` model sends each
    context + continuation as token ids with echo=true, logprobs=1, max_tokens=1 to /v1/completions and
    sums the echoed prompt logprobs of the continuation (the request every API harness makes);
  - `qwen3_gen`, a generate-until task: `local-chat-completions` sends the chat messages to
    /v1/chat/completions, greedy, 24 tokens, with a repetition penalty of 1.5 (vLLM's extension on the
    server, transformers' generate argument on `hf`): a random model's greedy text is one token repeated,
    which the penalty turns into text worth comparing, and it checks the penalty against transformers'.
The same tasks run through lm-eval's `hf` model on the same checkpoint (transformers, float32). The
script compares every sample: log-likelihoods within 1e-4, the greedy flag equal, the generated texts
equal, and exits 1 if any differs. One difference is by design and not counted: `hf` returns the raw
decoded text, while the chat API returns the parsed answer (text/chat_parser.py), which does not start
with the newlines Qwen3 writes before an answer; texts are compared with leading whitespace stripped. lm-eval is a test/benchmark dependency only (pip install lm-eval).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: server_process.py
from server_process import start_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Rome"], 0),
    ("Two plus two equals", [" four", " five", " three"], 0),
    ("The sky on a clear day is", [" blue", " green", " red"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("A language model predicts the next", [" token", " image", " sound"], 0),
    ("def greet(name", [")", "):", ", greeting)"], 1),
]
MC_TASK = """task: qwen3_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_TASK = """task: qwen3_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["<|no stop|>"]
  max_gen_toks: 24
  do_sample: false
  repetition_penalty: 1.5
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in QUESTIONS))
    (folder / "qwen3_mc.yaml").write_text(MC_TASK.format(data=data))
    (folder / "qwen3_gen.yaml").write_text(GEN_TASK.format(data=data))


def evaluate(model_type: str, model_args: str, tasks: list[str], include: Path, chat: bool) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model_type, model_args=model_args, tasks=tasks, log_samples=True,
                                  task_manager=TaskManager(include_path=str(include)), apply_chat_template=chat,
                                  batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0)  # fmt: skip
    return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in out["samples"].items()}  # fmt: skip


def compare(served: list, reference: list, kind: str) -> list[str]:
    problems = []
    for doc, (ours, theirs) in enumerate(zip(served, reference)):
        for choice, (a, b) in enumerate(zip(ours, theirs)):
            a, b = a[0], b[0]
            if kind == "loglikelihood":
                if abs(float(a[0]) - float(b[0])) > 1e-4 or bool(a[1]) != bool(b[1]):
                    problems.append(f"doc {doc} choice {choice}: served {a} vs hf {b}")
            elif a.lstrip() != b.lstrip():  # the chat API's answer starts after Qwen3's newlines (see the docstring)
                problems.append(f"doc {doc}: served {a!r} vs hf {b!r}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "weights" / "tiny-qwen3"))
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "lm_eval_compare.json"))
    args = p.parse_args()
    model = str(Path(args.model).resolve())
    include = Path(tempfile.mkdtemp())
    write_tasks(include)
    try:
        server, url = start_server(model, ["--served-model-name", "served", "--dtype", "float32", "--local-files-only"])
    except RuntimeError as error:
        raise SystemExit(f"qwen3-serve did not start: {error}") from None
    try:
        start = time.perf_counter()
        base = f"{url}/v1"
        served = evaluate("local-completions", f"model=served,base_url={base}/completions,tokenizer={model},"
                          "tokenized_requests=True,max_length=256", ["qwen3_mc"], include, chat=False)  # fmt: skip
        served |= evaluate("local-chat-completions", f"model=served,base_url={base}/chat/completions,tokenizer={model}",
                           ["qwen3_gen"], include, chat=True)  # fmt: skip
        served_s = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait()
    start = time.perf_counter()
    hf = evaluate("hf", f"pretrained={model},dtype=float32,device=cpu", ["qwen3_mc"], include, chat=False)
    hf |= evaluate("hf", f"pretrained={model},dtype=float32,device=cpu", ["qwen3_gen"], include, chat=True)
    hf_s = time.perf_counter() - start
    problems = compare(served["qwen3_mc"], hf["qwen3_mc"], "loglikelihood")
    problems += compare(served["qwen3_gen"], hf["qwen3_gen"], "generate")
    report = {"model": model, "served": served, "hf": hf, "problems": problems,
              "served_seconds": round(served_s, 1), "hf_seconds": round(hf_s, 1)}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    for task in ("qwen3_mc", "qwen3_gen"):
        for doc, (ours, theirs) in enumerate(zip(served[task], hf[task])):
            print(f"{task} doc {doc}: served {[r[0] for r in ours]}  hf {[r[0] for r in theirs]}")
    print(f"{len(problems)} differences" + "".join(f"\n  {x}" for x in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
