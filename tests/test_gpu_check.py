"""scripts/gpu_check.py's smoke run on the CPU (--smoke: every step, tiny shapes, about a minute): the engine
workload by both routes, our decode eager and through the graph runner's CPU stand-in, int4 and int8 by both
routes, transformers eager and with its static cache, the load benchmark; a failing step is recorded and the
run goes on, and the JSON and markdown report say what each step measured. A broken check fails here, in CI,
not in a GPU session."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from nano_vllm_workload import union_seconds  # noqa: E402


def dry_run(out: Path, weights: Path, *extra: str) -> tuple[dict, str]:
    # from outside the source tree and without this package on the path, as on the GPU machine
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out), "--weights", str(weights)]
    done = subprocess.run(command + list(extra), capture_output=True, text=True, timeout=300, cwd=out, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "] decode tiny (limit " in done.stdout, "each step prints a progress line as it starts"
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


pytestmark = pytest.mark.slow  # ~75 s on a 2-core AMD EPYC: nine steps, each a fresh Python, two at a time


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return dry_run(tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("weights"), "--smoke")


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """An unknown size beside the tiny one, only their decode steps (--steps), side by side (--jobs)."""
    return dry_run(tmp_path_factory.mktemp("gpu_check_fail"), tmp_path_factory.mktemp("weights_fail"), "--device",
                   "cpu", "--new-tokens", "4", "--sizes", "tiny,9B", "--steps", "decode tiny,decode 9B", "--jobs", "2")  # fmt: skip


def test_the_unmeasured_come_first_and_every_step_runs_under_a_limit(smoke):
    report, _ = smoke
    assert list(report["steps"]) == ["engine flex", "engine paged", "int4 tiny", "decode tiny", "int8 tiny",
                                     "profile bf16 tiny", "profile quantized tiny", "transformers tiny",
                                     "load benchmark", "cuda tests"]  # fmt: skip
    for name, step in report["steps"].items():
        assert "skipped" in step or 0 < step["limit_s"] <= 90, f"{name} ran without its smoke limit"
        assert "skipped" in step or step["returncode"] == 0, f"{name} failed: {step.get('output_tail')}"
    assert report["steps"]["cuda tests"] == {"skipped": "no CUDA device (a CPU run)"}


def test_smoke_decodes_eager_and_through_the_graph_runner_and_skips_compile(smoke):
    report, markdown = smoke
    results = report["steps"]["decode tiny"]["results"]
    for variant in ("bfloat16/eager", "bfloat16/graphs"):
        assert results[variant]["decode_tok_s"] > 0 and len(results[variant]["tokens"]) == 4, results[variant]
    assert results["bfloat16/graphs"]["tokens"] == results["bfloat16/eager"]["tokens"], "graphs changed the tokens"
    assert results["bfloat16/graphs-plain"]["tokens"] == results["bfloat16/eager"]["tokens"], "the plain layers did"
    assert results["bfloat16/compiled"] == {"skipped": "--compile is for CUDA"}
    assert "| tiny | bfloat16/graphs |" in markdown and "| tiny | bfloat16/compiled | --compile is for CUDA" in markdown


def test_smoke_measures_int4_first_then_int8_by_both_routes(smoke):
    report, _ = smoke
    int4, int8 = report["steps"]["int4 tiny"]["results"], report["steps"]["int8 tiny"]["results"]
    assert list(int4) == ["int4/compiled", "int4/graphs", "int4/graphs-plain"], "int4 compiled was the figure the last run missed"
    for variant in ("int4/graphs", "int8/graphs", "int8pack/graphs"):
        result = {**int4, **int8}[variant]
        assert result["decode_tok_s"] > 0 and result["bytes_per_step"] > 0, result


def test_smoke_profiles_a_decode_step_kernel_by_kernel(smoke):
    """The profile steps say what a decode step launches (on a CPU, its aten ops) and how long each takes."""
    report, markdown = smoke
    steps = report["steps"]
    profiles = {**steps["profile bf16 tiny"]["results"], **steps["profile quantized tiny"]["results"]}
    assert profiles.pop("profile bfloat16/compiled") == {"skipped": "--compile is for CUDA"}
    assert set(profiles) == {"profile bfloat16/graphs", "profile bfloat16/graphs-plain", "profile bfloat16/eager",
                             "profile int8/graphs", "profile int4/graphs", "profile int4/graphs-plain"}, profiles  # fmt: skip
    for key, r in profiles.items():
        assert r["kernels_per_step"] > 20 and r["kernel_us_per_step"] > 0 and r["wall_us_per_step"] > 0, (key, r)
        assert 0 < len(r["top"]) <= 14 and r["top"][0]["us_per_step"] >= r["top"][-1]["us_per_step"], (key, r)
    names = {t["kernel"] for t in profiles["profile int4/graphs"]["top"]} | {
        t["kernel"] for r in profiles.values() for t in r["top"]}
    assert any("mm" in n or "linear" in n for n in names), f"a step's products are among its costliest ops: {names}"
    assert "| tiny | profile bfloat16/graphs | kernels_per_step=" in markdown


def test_smoke_times_transformers_eager_and_with_a_static_cache(smoke):
    report, markdown = smoke
    results = report["steps"]["transformers tiny"]["results"]
    eager, static = results["transformers/eager"], results["transformers/static-compile"]
    assert eager["decode_tok_s"] > 0 and static["decode_tok_s"] > 0, results
    assert static["tokens"] == eager["tokens"][: len(static["tokens"])], "the static cache changed transformers' tokens"
    assert static["compiled"] is False and "not compiled: transformers compiles on GPUs only" in markdown


def test_smoke_runs_the_engine_workload_by_both_routes(smoke):
    report, markdown = smoke
    for route in ("flex", "paged"):
        result = report["steps"][f"engine {route}"]["results"][f"engine/workload {route}"]
        assert result["output_tok_s"] > 0 and result["output_tokens"] > 0, result
        assert result["route"] == route and result["fallback"] is None, f"the {route} route did not run: {result}"
        assert "gpu_busy" not in result, "a CPU run has no GPU kernels to count"
        profiled = result["host_profile"]  # where the host's time goes, prefill steps and decode steps apart
        assert profiled["prefill_steps"] >= 1 and profiled["prefill"] and profiled["decode"], profiled
        assert all(row["own_ms_per_step"] >= 0 for row in profiled["prefill"] + profiled["decode"])
        assert f"| tiny | engine/workload {route} (4 requests" in markdown
    overlapped, at_once = (report["steps"]["engine flex"]["results"][f"engine/workload {v}"] for v in ("flex", "flex-sync"))
    assert overlapped["async_scheduling"] is True and at_once["async_scheduling"] is False
    assert overlapped["output_tokens"] == at_once["output_tokens"] > 0


def test_a_failing_step_is_recorded_and_the_next_one_runs(failing):
    report, markdown = failing
    assert list(report["steps"]) == ["decode tiny", "decode 9B"], "--steps picks the steps to run"
    failed = report["steps"]["decode 9B"]
    assert failed["returncode"] not in (0, None) and "unknown Qwen3 size '9B'" in failed["output_tail"]
    assert "| decode 9B | 130 | FAILED (exit 1)" in markdown
    assert report["steps"]["decode tiny"]["results"]["bfloat16/graphs"]["decode_tok_s"] > 0


def test_busy_time_counts_overlapping_kernels_once():
    assert union_seconds([(0, 10), (5, 20), (30, 40), (32, 35)]) == pytest.approx(30e-6)
    assert union_seconds([]) == 0.0


def test_a_cpu_run_keeps_int4_in_torchs_packing_as_a_gpu_does_unless_told_otherwise(tmp_path, monkeypatch):
    """The steps inherit the check's environment: on a CPU their int4 runs torch's packing, the layout a GPU runs.
    An AVX2 CPU would pick the words layout and build its kernels at load, and a hand-run smoke's two int4 steps
    ran into their 60-s limit that way on an AMD EPYC Zen 3. A layout the user set is kept."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for chosen, wanted in ((None, "torch"), ("words", "words")):
        if chosen is None:
            monkeypatch.delenv("QWEN3_SCRATCH_INT4_LAYOUT", raising=False)
        else:
            monkeypatch.setenv("QWEN3_SCRATCH_INT4_LAYOUT", chosen)
        assert gpu_check.main(["--out", str(tmp_path), "--smoke", "--steps", "cuda tests"]) == 0
        assert os.environ["QWEN3_SCRATCH_INT4_LAYOUT"] == wanted
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["steps"] == {"cuda tests": {"skipped": "no CUDA device (a CPU run)"}}
