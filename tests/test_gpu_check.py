"""scripts/gpu_check.py's dry run on the CPU: every step that needs no CUDA runs (our decode through the graph
runner's CPU stand-in, transformers eager and with its static cache, int8 by both routes and int4, the engine
workload and the busy-fraction profile), a failing step is recorded and the run goes on, and the JSON and
markdown report say what each step measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from gpu_workers import union_seconds  # noqa: E402


def dry_run(out: Path, weights: Path, *extra: str) -> tuple[dict, str]:
    # from outside the source tree and without this package on the path, as on the GPU machine
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--new-tokens", "4",
         "--out", str(out), "--weights", str(weights), *extra],
        capture_output=True, text=True, timeout=300, cwd=out, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "] decode" in done.stdout, "each step prints a progress line as it starts"
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return dry_run(tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("weights"), "--sizes", "tiny")


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """An unknown size beside the MoE shapes, only their decode steps (--steps)."""
    return dry_run(tmp_path_factory.mktemp("gpu_check_fail"), tmp_path_factory.mktemp("weights_fail"),
                   "--sizes", "tiny-moe,9B", "--steps", "decode tiny-moe,decode 9B")  # fmt: skip


def test_dry_run_decodes_eager_and_through_the_graph_runner_and_skips_compile(tiny):
    report, markdown = tiny
    results = report["steps"]["decode tiny"]["results"]
    for variant in ("bfloat16/eager", "bfloat16/graphs"):
        assert results[variant]["decode_tok_s"] > 0 and len(results[variant]["tokens"]) == 4, results[variant]
    assert results["bfloat16/graphs"]["tokens"] == results["bfloat16/eager"]["tokens"], "graphs changed the tokens"
    assert results["bfloat16/compiled"] == {"skipped": "--compile is for CUDA"}
    assert "| tiny | bfloat16/graphs |" in markdown and "| tiny | bfloat16/compiled | --compile is for CUDA" in markdown


def test_dry_run_measures_int8_by_both_routes_and_int4(tiny):
    report, _ = tiny
    results = report["steps"]["int8/int4 tiny"]["results"]
    for variant in ("int8/graphs", "int8pack/graphs", "int4/graphs"):
        assert results[variant]["decode_tok_s"] > 0 and results[variant]["bytes_per_step"] > 0, results[variant]
    assert set(results) == {"int8/graphs", "int8pack/graphs", "int4/graphs", "int8/compiled", "int4/compiled"}


def test_dry_run_times_transformers_eager_and_with_a_static_cache(tiny):
    report, markdown = tiny
    results = report["steps"]["transformers tiny"]["results"]
    eager, static = results["transformers/eager"], results["transformers/static-compile"]
    assert eager["decode_tok_s"] > 0 and static["decode_tok_s"] > 0, results
    assert static["tokens"] == eager["tokens"][: len(static["tokens"])], "the static cache changed transformers' tokens"
    assert static["compiled"] is False and "not compiled: transformers compiles on GPUs only" in markdown


def test_dry_run_profiles_an_engine_run_and_calls_the_workload_script(tiny):
    report, _ = tiny
    busy = report["steps"]["engine busy"]["results"]["engine/busy"]
    assert busy["steps"] > 0 and busy["output_tok_s"] > 0, busy
    assert busy["gpu_busy_fraction"] is None, "a CPU run has no GPU kernels to count"
    workload = report["steps"]["engine workload"]["results"]["engine/workload"]
    if (ROOT / "scripts" / "bench" / "nano_vllm_workload.py").exists():
        assert "error" not in workload and "skipped" not in workload, workload
    else:
        assert workload["skipped"].startswith("not available"), workload


def test_every_step_has_a_limit_and_cuda_only_steps_say_why_they_were_skipped(tiny):
    report, markdown = tiny
    assert report["machine"]["device"] == "cpu"
    for name, step in report["steps"].items():
        assert "skipped" in step or step["limit_s"] > 0, f"{name} ran without a time limit"
    assert report["steps"]["cuda tests"] == {"skipped": "no CUDA device (dry run)"}
    assert "skipped" in report["steps"]["load benchmark"]


def test_a_failing_step_is_recorded_and_the_next_one_runs(failing):
    report, markdown = failing
    assert list(report["steps"]) == ["decode tiny-moe", "decode 9B"], "--steps picks the steps to run"
    failed = report["steps"]["decode 9B"]
    assert failed["returncode"] not in (0, None) and "unknown Qwen3 size '9B'" in failed["output_tail"]
    assert "| decode 9B | 110 | FAILED (exit 1)" in markdown
    moe = report["steps"]["decode tiny-moe"]["results"]
    assert moe["bfloat16/graphs"]["decode_tok_s"] > 0, "MoE layers cannot be graphed: the loop runs them eagerly"


def test_busy_time_counts_overlapping_kernels_once():
    assert union_seconds([(0, 10), (5, 20), (30, 40), (32, 35)]) == pytest.approx(30e-6)
    assert union_seconds([]) == 0.0
