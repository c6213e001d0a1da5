"""scripts/gpu_check.py's dry run on the CPU: the steps run, a failing step is recorded and the run goes
on, and the JSON and markdown report say what each step measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out, weights = tmp_path_factory.mktemp("gpu_check"), tmp_path_factory.mktemp("weights")
    # from outside the source tree and without this package on the path, as on the GPU machine
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--sizes", "tiny,tiny-moe,9B",
         "--new-tokens", "4", "--out", str(out), "--weights", str(weights)],
        capture_output=True, text=True, timeout=240, cwd=out, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_dry_run_decodes_bf16_int8_and_int4_and_skips_what_needs_cuda(dry_run):
    report, _ = dry_run
    results = report["steps"]["decode tiny"]["results"]
    for variant in ("bfloat16/eager", "int8/eager", "int4/eager"):
        assert results[variant]["decode_tok_s"] > 0 and len(results[variant]["tokens"]) == 4, results[variant]
    assert results["bfloat16/compiled"] == {"skipped": "CUDA graphs need CUDA"}
    assert "skipped" in report["steps"]["cuda tests"] and "skipped" in report["steps"]["load benchmark"]


def test_dry_run_decodes_the_moe_shapes_drawn_in_memory(dry_run):
    report, markdown = dry_run
    step = report["steps"]["decode tiny-moe"]
    assert step["returncode"] == 0, step.get("output_tail")
    for variant in ("bfloat16/eager", "int8/eager"):
        result = step["results"][variant]
        assert result["decode_tok_s"] > 0 and len(result["tokens"]) == 4, result
        assert 0 < result["bytes_per_step"], "the MoE row reports the bytes a step really reads"
    assert "| tiny-moe | bfloat16/eager |" in markdown


def test_a_failing_step_is_recorded_and_the_run_goes_on(dry_run):
    report, _ = dry_run
    failed = report["steps"]["decode 9B"]
    assert failed["returncode"] not in (0, None) and "unknown Qwen3 size '9B'" in failed["output_tail"]
    assert "load benchmark" in report["steps"], "the steps after a failure must still run"


def test_markdown_report_has_a_row_per_measurement(dry_run):
    _, markdown = dry_run
    assert "| tiny | bfloat16/eager |" in markdown and "| tiny | int8/eager |" in markdown
    assert "| decode 9B | FAILED (exit 1)" in markdown
