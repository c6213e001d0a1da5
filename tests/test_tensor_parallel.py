"""Tensor parallelism over torch.distributed (gloo, 2 processes on the CPU), against one device.

One group of 2 ranks serves the whole module (spawning a worker imports torch anew: seconds), and every
model here is loaded into it. The reference is always the same checkpoint loaded on one device: fp32
logits within 1e-5 relative (the all-reduce sums in another order), greedy tokens identical, through
the simple loops, a multi-turn chat whose cache grows, and the engine's continuous batching.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from make_tiny_checkpoint import make_tiny_checkpoint

from qwen3_scratch import load_model
from qwen3_scratch.engine.llm import LLM
from qwen3_scratch.generation.loops import generate_tokens
from qwen3_scratch.generation.pipeline import Pipeline
from qwen3_scratch.model.sizes import all_sizes, moe_parameter_counts, parameter_count, per_rank_bytes
from qwen3_scratch.parallel.group import get_group
from qwen3_scratch.parallel.model import load_parallel_model
from qwen3_scratch.parallel.plan import ParallelError
from qwen3_scratch.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [11, 12, 13]]  # two lengths: the batch is left-padded


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    return {"dense": make_tiny_checkpoint(base / "dense"), "moe": make_tiny_checkpoint(base / "moe", moe=True)}


@pytest.fixture(scope="module")
def group():
    threads = torch.get_num_threads()
    group = get_group(2, "cpu")
    yield group
    group.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(checkpoints, group):
    """{kind: (one device, two ranks)}, fp32, the checkpoint's own layout."""
    return {kind: (load_model(path), load_parallel_model(path, 2)) for kind, path in checkpoints.items()}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_ranks_give_one_devices_logits(models, kind):
    one, two = models[kind]
    assert two.config.num_attention_heads == one.config.num_attention_heads // 2, "the model is not split"
    ids = torch.tensor([p + [0] * (7 - len(p)) for p in PROMPTS])  # (2, 7)
    a, b = one(ids), two(ids)
    error = ((a - b).abs().max() / a.abs().max()).item()
    assert error < 1e-5, f"{kind}: TP=2 logits differ from TP=1 by {error:.2e} relative"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_ranks_give_one_devices_greedy_tokens(models, kind):
    one, two = models[kind]
    expected = torch.stack(list(generate_tokens(one, PROMPTS, 24))).T.tolist()
    got = torch.stack(list(generate_tokens(two, PROMPTS, 24))).T.tolist()
    assert got == expected, f"{kind}: greedy tokens under TP=2 differ from TP=1"


def test_pipeline_and_chat_with_a_growing_cache_match_one_device(checkpoints, group):
    """Pipeline.load(tensor_parallel_size=2), its decode layout, and a conversation whose KV cache is
    outgrown and copied (the workers' mirrors must copy too)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    pipes = [Pipeline.load(checkpoints["dense"], dtype="float32", tensor_parallel_size=n) for n in (1, 2)]
    answers = []
    for pipe in pipes:
        pipe.conversation.block = 16  # small blocks: turn 2 outgrows turn 1's cache
        messages = [{"role": "user", "content": "Name a prime number."}]
        reply = pipe.chat(messages, params)
        messages += [reply, {"role": "user", "content": "And the next one, please?"}]
        answers.append([reply, pipe.chat(messages, params), pipe.conversation.last_stats.reused_tokens])
    assert answers[1] == answers[0]
    assert answers[0][2] > 0, "turn 2 reused nothing: the cache copy was not exercised"


def test_engine_under_two_ranks_gives_the_simple_loops_answers(checkpoints, models, group):
    one, _ = models["dense"]
    llm = LLM(str(checkpoints["dense"]), dtype="float32", tensor_parallel_size=2, num_blocks=64, max_num_seqs=4)
    prompts = PROMPTS + [[200, 201], list(range(30, 70))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected = torch.stack(list(generate_tokens(one, [prompt], 12))).flatten().tolist()
        assert out.outputs[0].token_ids == expected, f"prompt {prompt[:5]}...: the engine under TP=2 diverged"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_per_rank_sizes_count_what_a_rank_really_holds(checkpoints, models, kind):
    """model/sizes.py's per-rank arithmetic (docs/parallel.md's table) against the parameters a loaded rank holds."""
    config = json.loads((checkpoints[kind] / "config.json").read_text())
    held = sum(p.numel() * p.element_size() for p in models[kind][1].parameters())  # fp32, a tied head once
    assert per_rank_bytes(config, 2, bytes_per_value=4)[0] == held


def test_per_rank_sizes_at_one_rank_are_the_published_parameter_counts():
    for name, config in all_sizes().items():
        total = moe_parameter_counts(config)[0] if "num_experts" in config else parameter_count(name)
        assert per_rank_bytes(config, 1, bytes_per_value=1)[0] == total, name
    assert per_rank_bytes(all_sizes()["14B"], 16) is None  # 40 query heads over 16 ranks


def test_the_server_answers_from_two_ranks_as_from_one(checkpoints, group):
    from fastapi.testclient import TestClient

    from qwen3_scratch.server.app import build_app
    from qwen3_scratch.server.async_engine import AsyncEngine

    request = {"model": "tiny", "prompt": [5, 17, 99, 3], "max_tokens": 10, "temperature": 0}
    texts = []
    for n in (1, 2):
        llm = LLM(str(checkpoints["dense"]), dtype="float32", tensor_parallel_size=n, num_blocks=32)
        engine = AsyncEngine(llm.engine).start()
        try:
            with TestClient(build_app(engine, llm.tokenizer, "tiny", llm.get_default_sampling_params())) as client:
                texts.append(client.post("/v1/completions", json=request).json()["choices"][0]["text"])
        finally:
            engine.stop()
    assert texts[1] == texts[0] and texts[0]


def test_a_size_that_cannot_split_the_model_is_refused_in_one_line(checkpoints, capsys):
    with pytest.raises(ParallelError) as caught:
        load_parallel_model(checkpoints["dense"], 3)
    message = str(caught.value)
    assert "--tensor-parallel-size 3" in message and "num_attention_heads=4" in message and "\n" not in message
    from qwen3_scratch.cli.generate import main

    assert main(["--model", str(checkpoints["dense"]), "--prompt", "x", "--tensor-parallel-size", "3"]) == 2
    assert capsys.readouterr().err.strip() == f"qwen3-generate: error: {message}"


def test_a_killed_rank_ends_the_parent_in_one_line(checkpoints):
    """SIGKILL rank 1 while rank 0 is generating: the command ends, exit code 2, one line naming the rank."""
    command = [sys.executable, "-m", "qwen3_scratch.generate", "--model", str(checkpoints["dense"]), "--no-chat",
               "--prompt", "Once upon a time", "--max-new-tokens", "1800", "--ignore-eos", "--temperature", "0",
               "--tensor-parallel-size", "2"]  # fmt: skip
    parent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        assert parent.stdout.read(1), "no token came out"  # generating: rank 1 is busy in the collectives
        children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        workers = [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1, f"expected one spawned rank among the children {children}"
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        _, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    lines = err.decode().strip().splitlines()
    assert parent.returncode == 2, f"exit code {parent.returncode}; stderr: {lines}"
    assert len(lines) == 1 and "rank 1 was killed by signal 9" in lines[0], lines
    assert time.monotonic() - start < 30


HUNG_RANK = """
import os, signal, sys, time, torch
from qwen3_scratch.errors import Qwen3Error
from qwen3_scratch.parallel.model import load_parallel_model

model = load_parallel_model(sys.argv[1], 2, timeout_s=3)
model(torch.tensor([[1, 2, 3]]))
os.kill(model.group.workers[0].pid, signal.SIGSTOP)  # alive, but it will never answer
start = time.monotonic()
try:
    model(torch.tensor([[1, 2, 3]]))
except Qwen3Error as error:
    print(f"{time.monotonic() - start:.1f}", error)
"""


def test_a_hung_rank_ends_the_forward_after_the_collective_timeout(checkpoints):
    """SIGSTOP rank 1: rank 0's collective gives up after timeout_s (3 s here), in one line, and the process
    exits (the stopped worker is killed, not waited for)."""
    run = subprocess.run([sys.executable, "-c", HUNG_RANK, str(checkpoints["dense"])], capture_output=True,
                         text=True, timeout=90, cwd=ROOT)  # fmt: skip
    seconds, _, message = run.stdout.strip().partition(" ")
    assert "did not answer within 3 s" in message, (run.stdout, run.stderr[-2000:])
    assert float(seconds) < 20, f"the forward took {seconds} s to give up"
