"""jobs/device_check.py runs end to end on a CPU with --quick: one JSON summary (printed and written to $OUT) whose
checks all passed - the training step's device copies match the CPU step, every engine variant's greedy output
equals plain decoding's, and the padded ("graphs") variants really ran padded."""
from __future__ import annotations

import json

from jobs import device_check


def test_quick_cpu_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    summary = device_check.main(["--device", "cpu", "--quick"])
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "device_check.json").read_text())
    assert printed == written and written["device"] == "cpu" and written["quick"] is True
    assert summary["target"]["kind"] == "random" and summary["target"]["shape"] == "tiny"
    tr = summary["training"]
    assert tr["supervised"] > 0 and tr["device_fp32"]["ok"] and tr["device_bf16"]["ok"], tr
    assert tr["device_fp32"]["grad_rel_err_max"] == 0.0  # the "device" is the CPU here: the very same step
    runs = summary["engine"]["float32/batch2"]
    assert set(runs) == {"plain_eager", "plain_graphs", "dspark_eager", "dspark_graphs"}
    for name, r in runs.items():
        assert r["greedy_equals_plain_eager"] and r["matching_requests"] == 2, (name, r)
        assert r["tokens_per_s"] > 0
    assert runs["plain_graphs"]["target_padded_runs"] > 0 and runs["dspark_graphs"]["draft_padded_runs"] > 0
    assert runs["dspark_graphs"]["target_graphs"] == 0  # no capture on a CPU
    assert runs["dspark_eager"]["tau"] >= 1.0 and runs["plain_eager"]["tau"] == 1.0
    assert summary["tests"] == {"skipped": "--quick / --no-pytest"}
