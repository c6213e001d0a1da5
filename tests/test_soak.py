"""The short soak: scripts/bench/soak.py for ~12 s against the real `qwen3-serve` over a tiny checkpoint.

Clients send valid, invalid, dropped and long requests at once; the script fails unless every valid
request got 200, every invalid one a 4xx, nothing is held at the end, memory did not grow past the
bound after the warm-up, and SIGTERM stopped the server with exit status 0. The long run's figures are
in docs/performance.md.
"""

import json

from make_tiny_checkpoint import make_tiny_checkpoint
from soak import main


def test_a_short_soak_serves_every_valid_request_refuses_every_invalid_one_and_holds_nothing(tmp_path, capsys):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny")
    status = main(["--model", str(checkpoint), "--clients", "6", "--warmup", "3", "--duration", "9",
                   "--max-rss-growth-mb", "400", "--server-args", "--num-blocks 128 --shutdown-grace 5"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert status == 0, report["failures"]
    kinds = {answer.split()[0] for answer in report["answers"]}
    assert kinds == {"chat", "completion", "long", "aborted", "invalid"}, f"every kind was sent: {report['answers']}"
    assert report["held_at_end"]["qwen3_kv_blocks_used"] == 0 and report["sigterm"]["exit_status"] == 0
