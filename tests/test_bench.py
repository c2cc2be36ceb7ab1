"""The benchmark CLI (`python -m jobs.bench`): the listing names every benchmark without importing torch, vllm or
ray; the harness's interleaving, medians and results.json through a real CLI run of its own busy_loop benchmark;
one real benchmark (the drafter's, at tiny sizes) end to end."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.bench import discover, inspect_module
from jobs.bench.harness import Harness, call_order

ROOT = Path(__file__).resolve().parent.parent
PORTED = {"extract", "target", "linear", "drafter", "draft_budget", "vllm_dtype", "one_user", "load", "heldout_tau",
          "peak_memory", "train_step", "learning_curves", "busy_loop", "domain_share", "draft_decision",
          "depth_cost"}


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSPARK_NO_REEXEC="1")
    return subprocess.run([sys.executable, "-m", "jobs.bench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_benchmark_without_heavy_imports():
    p = bench("--help")
    assert p.returncode == 0, p.stderr
    listed = {line.split()[0] for line in p.stdout.split("benchmarks:\n", 1)[1].split("\n\n", 1)[0].splitlines()}
    assert PORTED <= listed, PORTED - listed
    assert "broken" not in p.stdout
    probe = ("import sys; from jobs.bench.__main__ import listing; listing(); "
             "print(sorted(m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_domain_share_arguments_parse_in_the_documented_order():
    # the order its --help shows: one --domain per suite, then the runs
    import argparse

    from jobs.bench import domain_share

    p = argparse.ArgumentParser()
    domain_share.add_arguments(p)
    a = p.parse_args(["--data", "d", "--domain", "gsm8k=gsm8k_train", "--domain", "humaneval=x,y",
                      "m=run_m", "c=run_c"])
    assert a.domain == ["gsm8k=gsm8k_train", "humaneval=x,y"] and a.runs == ["m=run_m", "c=run_c"]
    assert "--domain gsm8k=gsm8k_train --domain humaneval=" in domain_share.__doc__


def test_unknown_benchmark_and_malformed_module(tmp_path):
    p = bench("no_such_benchmark")
    assert p.returncode != 0 and "unknown benchmark 'no_such_benchmark'" in p.stderr
    bad = tmp_path / "half.py"
    bad.write_text('NAME = "half"\nHELP = "x"\ndef run(args, harness):\n    return {}\n')
    assert inspect_module(bad).problem == "no add_arguments function"
    bad.write_text('NAME = "other"\nHELP = "x"\n')
    assert "differs from the file name" in inspect_module(bad).problem
    assert all(info.problem is None for info in discover().values())


def test_call_order_and_interleave_in_process(tmp_path):
    assert [call_order(["A", "B"], r, "alternate") for r in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert [call_order(["A", "B", "C"], r, "rotate") for r in range(3)] == [["A", "B", "C"], ["B", "C", "A"],
                                                                             ["C", "A", "B"]]
    h = Harness("t", tmp_path, ["t"])
    calls, marks = [], []
    values = {"A": [100.0, 1.0, 3.0, 2.0], "B": [100.0, 10.0, 30.0, 20.0]}
    s = h.interleave({c: (lambda rep, c=c: (calls.append((c, rep)), {"v": values[c][rep]})[1]) for c in "AB"}, 3,
                     warmup=1, after_warmup=lambda: marks.append(len(calls)))
    assert marks == [2]  # after the warm-up repetition, before the first measured call
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2), ("B", 3), ("A", 3)]
    assert s.values("A", "v") == [1.0, 3.0, 2.0]  # warm-up value 100 left out
    assert s.median("A", "v") == 2.0 and s.median("B", "v") == 20.0 and s.total("B", "v") == 60.0
    assert len(s.values("A")) == 3  # wall_s always recorded
    table = h.compare(s, "v", baseline="A")
    assert table["B"]["ratio"] == pytest.approx(10.0)
    with pytest.raises(ValueError):
        h.interleave({"A": lambda rep: None}, 0)
    with pytest.raises(TypeError):
        h.interleave({"A": lambda rep: "text"}, 1)


def test_busy_loop_through_the_cli(tmp_path):
    p = bench("busy_loop", "--iterations", "20000", "--reps", "5", "--warmup", "1", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "[bench] CPU " in p.stdout and "torch " in p.stdout
    doc = json.loads((tmp_path / "results.json").read_text())
    assert not list(tmp_path.glob(".*.tmp"))
    env = doc["environment"]
    assert env["cores"] >= 1 and env["torch"] and isinstance(env["bf16"], list)
    s = doc["samples"]["loops"]
    # measured repetitions 1..5 after one warm-up: B A, A B, B A, ...
    assert s["calls"] == [["2x", "1x"], ["1x", "2x"], ["2x", "1x"], ["1x", "2x"], ["2x", "1x"]]
    wall = {c: s["metrics"][c]["wall_s"] for c in ("1x", "2x")}
    assert all(len(v) == 5 for v in wall.values())
    assert s["metrics"]["2x"]["iterations"] == [40000.0] * 5
    med = {c: statistics.median(v) for c, v in wall.items()}
    assert doc["results"]["median_ms"]["1x"] == pytest.approx(med["1x"] * 1e3)
    assert doc["results"]["ratio_2x_to_1x"] == pytest.approx(med["2x"] / med["1x"])
    assert doc["results"]["ratio_2x_to_1x"] > 1.0  # twice the work takes longer
    (title, table), = doc["tables"].items()
    assert [r[0] for r in table["rows"]] == ["1x", "2x"]


def test_drafter_benchmark_end_to_end(tmp_path):
    p = bench("drafter", "--layers", "1", "--draft-vocab", "512", "--seq", "64", "--prompt", "8", "--anchors", "8",
              "--steps", "2", "--context", "32", "--rounds", "2", "--out", str(tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr
    assert "TRAIN:" in p.stdout and "DRAFT ROUND: batch 4" in p.stdout
    doc = json.loads((tmp_path / "results.json").read_text())
    r = doc["results"]
    assert r["train"]["positions_per_s"] > 0 and r["draft_vocab"] == 512
    assert set(r["draft_round"]) == {f"batch {b}, T={t}" for b in (1, 4) for t in (0.0, 1.0)}
    steps = doc["samples"]["train"]["metrics"]["train step"]
    assert len(steps["positions"]) == 2 and all(x > 0 for x in steps["positions"])
    rounds = doc["samples"]["draft round batch 1"]
    assert len(rounds["calls"]) == 2 and rounds["calls"] == [["T=0.0", "T=1.0"], ["T=1.0", "T=0.0"]]  # after 2 warm-ups
    assert r["draft_round"]["batch 1, T=0.0"]["propose_ms"] == pytest.approx(
        statistics.median(rounds["metrics"]["T=0.0"]["propose_s"]) * 1e3)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_load_benchmark_includes_vllm_plain_decoding(tmp_path):
    """The load test deploys vLLM's plain decoding next to our systems (same API, same prompts) and rates every
    system against the fastest no-speculation one at each concurrency."""
    p = bench("load", "--random-drafter", "--systems", "none", "hardware", "--vllm-baselines", "bfloat16",
              "--concurrency", "1", "2", "--requests-per-level", "2", "--max-tokens", "8", "--max-batch", "4",
              "--port", str(free_port()), "--time-budget", "400", "--out", str(tmp_path), timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    res = doc["results"]["results"]
    assert set(res) == {"no-spec", "load-aware", "vllm-bfloat16"}
    assert doc["results"]["meta"]["no_spec_systems"] == ["no-spec", "vllm-bfloat16"]
    for label, levels in res.items():
        assert [lv["concurrency"] for lv in levels] == [1, 2], label
        for lv in levels:
            assert lv["errors"] == 0 and lv["output_tok_s"] > 0, (label, lv)
    for c in (0, 1):
        fastest = max(("no-spec", "vllm-bfloat16"), key=lambda s: res[s][c]["output_tok_s"])
        for label in res:
            assert res[label][c]["fastest_no_spec"] == fastest
        assert res[fastest][c]["vs_fastest_no_spec"] == pytest.approx(1.0)
        assert all(res[s][c]["vs_fastest_no_spec"] <= 1.0 + 1e-9 for s in ("no-spec", "vllm-bfloat16"))
    for label, levels in res.items():  # where the time goes: the native engine's rounds, CPU by process role
        for lv in levels:
            if label == "vllm-bfloat16":
                assert lv["engine_ms_per_round"] is None
            else:
                assert lv["engine_ms_per_round"] > 0 and 0 < lv["engine_busy"] <= 1.05, (label, lv)
            assert lv["cpu_s_per_1k_tokens"]["engine"] > 0 and lv["cpu_s_per_1k_tokens"]["client"] > 0, (label, lv)
    assert "where the time goes" in p.stdout
    assert (tmp_path / "load_test.png").is_file()


def test_depth_cost_reports_round_costs_and_break_even_tau(tmp_path):
    """Plain decoding vs fixed depth 1 and 2 with a random drafter at batch 1 and 2: every request gets its
    --max-tokens (EOS ignored), the plain system's tau and break-even tau are 1, a random drafter's tau is ~1, a
    depth's break-even tau is its round time over the plain round time (rounds with the whole batch decoding)."""
    p = bench("depth_cost", "--draft-vocab", "512", "--batch", "1", "2", "--depths", "1", "2", "--max-tokens", "6",
              "--passes", "1", "--out", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    batches = doc["results"]["batches"]
    assert set(batches) == {"1", "2"}
    for n, per in batches.items():
        assert set(per) == {"plain", "depth 1", "depth 2"}
        assert per["plain"]["tau"] == 1.0 and per["plain"]["break_even_tau"] == pytest.approx(1.0)
        for name, r in per.items():
            assert r["tok_s"] > 0 and r["full_rounds"] > 0
            assert r["full_batch_over_plain"] == pytest.approx(r["tau"] / r["break_even_tau"])
            plain_ms = per["plain"]["ms_per_round"]["total"]
            assert r["break_even_tau"] == pytest.approx(r["ms_per_round"]["total"] / plain_ms)
            if name != "plain":
                assert 1.0 <= r["tau"] < 1.5 and r["ms_per_round"]["draft"] > 0  # a random drafter: ~nothing accepted
        tokens = doc["samples"][f"batch {n}"]["metrics"]["plain"]["tokens"]
        assert all(t == 6 * int(n) for t in tokens)
    assert "break-even tau" in p.stdout


def test_learning_curves_against_training_seconds(tmp_path):
    """--x seconds: each held-out point at the training seconds so far (positions since the previous row / that
    row's positions_per_s, summed: evaluations are not in the rate, so they add nothing); the CLI prints and plots
    them; a resumed run's repeated step replaces the earlier row."""
    from pipeline.train.metrics import read_learning_curve, training_seconds

    rows = [{"step": 5, "positions_seen": 1000, "positions_per_s": 100.0},
            {"step": 10, "positions_seen": 3000, "positions_per_s": 200.0, "heldout_tau": 1.5},
            {"step": 10, "positions_seen": 3000, "positions_per_s": 400.0, "heldout_tau": 1.6},  # resumed: replaces
            {"step": 15, "positions_seen": 4000, "positions_per_s": 50.0, "heldout_tau": 2.0,
             "heldout_walk_tau": 1.8}]
    m = tmp_path / "run" / "metrics.jsonl"
    m.parent.mkdir()
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert training_seconds(m) == pytest.approx({5: 10.0, 10: 15.0, 15: 35.0})
    assert [v for point in read_learning_curve(m, x="seconds") for v in point] == pytest.approx([15, 1.6, 35, 2.0])
    assert read_learning_curve(m) == [(3000, 1.6), (4000, 2.0)]
    p = bench("learning_curves", f"run={m.parent}", "--x", "seconds", "--png", str(tmp_path / "c.png"), "--out",
              str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    assert "run: 15s -> 1.600, 35s -> 2.000 (replayed 1.800)" in p.stdout
    assert (tmp_path / "c.png").stat().st_size > 0
    p = bench("learning_curves", f"run={m.parent}", "--key", "heldout_walk_tau", "--out", str(tmp_path / "out"))
    assert p.returncode != 0 and "--key heldout_walk_tau: name the teacher-forced curve (heldout_tau)" in p.stderr


def test_one_user_replica_closed_loop_streams_and_prefill_layouts(tmp_path):
    """The replica level with closed-loop streams (each sends 2 requests in turn), bf16 target, coalesced events,
    EOS ignored, both prefill layouts: every request gets its --max-tokens, every system reports per-pass rates,
    the load-aware / no-spec and mixed / padded ratios of the medians, and its rounds by kind, which add up to the
    engine's rounds."""
    p = bench("one_user", "--level", "replica", "--batch", "2", "--requests-per-stream", "2", "--max-tokens", "6",
              "--ignore-eos", "--dtype", "bfloat16", "--stream-interval", "3", "--layouts", "mixed", "padded",
              "--passes", "1", "--out", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    r = doc["results"]["replica"]
    names = {"none", "hardware", "none/padded", "hardware/padded"}
    assert set(r["tok_s_median"]) == names
    smp = doc["samples"]["replica"]["metrics"]
    for n in names:
        assert smp[n]["tokens"] == [4 * 6, 4 * 6], n  # 2 units of 2 streams x 2 requests x 6 tokens
        assert len(r["tok_s_per_pass"][n]) == 1 and r["tok_s_median"][n] > 0
        kinds = r["round_kinds"][n]
        assert set(kinds) <= {"decode", "mixed", "prefill"} and kinds["decode"]["rounds"] > 0, (n, kinds)
        assert sum(k["rounds"] for k in kinds.values()) == r["timers"][n]["steps"], (n, kinds, r["timers"][n])
        split = r["decode_split"][n]  # decode rounds with and without verified drafts
        assert sum(k["rounds"] for k in split.values()) == kinds["decode"]["rounds"], (n, split)
        assert n.startswith("hardware") or set(split) == {"1 token per row"}, (n, split)
    assert r["load_aware_over_no_spec"] == pytest.approx(r["tok_s_median"]["hardware"] / r["tok_s_median"]["none"])
    assert set(r["ratios"]) == {"hardware / none", "hardware/padded / none/padded", "none / none/padded",
                                "hardware / hardware/padded"}
    assert all(r["round_kinds"][n]["prefill"]["rounds"] >= 2 for n in names)  # each unit starts with a prefill
