"""The recipe's prompt mix and time budget (pipeline/launch/recipe.py) and the job's usage errors (jobs.recipe)."""
import json

import pytest

from pipeline.data.prompts import read_prompt_files
from pipeline.launch.recipe import (BudgetSplit, decode_seconds, next_growth, parse_mix, plan_budget, round_cost,
                                    probe_step_seconds, steps_that_fit, training_seconds, write_mix)


def _prompts(path, n, bad_lines=()):
    rows = []
    for i in range(n):
        rows.append("{not json" if i in bad_lines else json.dumps({"turns": [f"question {path.stem} {i}"]}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_parse_mix_names_what_is_wrong(tmp_path):
    a, b = _prompts(tmp_path / "a.jsonl", 5), _prompts(tmp_path / "b.jsonl", 3)
    mix = parse_mix([f"{a}:4", str(b)])
    assert [(e.stem, e.count) for e in mix] == [("a", 4), ("b", None)]
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*missing.jsonl"):
        parse_mix([str(tmp_path / "missing.jsonl") + ":3"])
    with pytest.raises(ValueError, match="count must be >= 1"):
        parse_mix([f"{a}:0"])
    (tmp_path / "other").mkdir()
    twin = _prompts(tmp_path / "other" / "a.jsonl", 2)
    with pytest.raises(ValueError, match="share the name 'a'"):
        parse_mix([str(a), str(twin)])
    with pytest.raises(ValueError, match="no prompt files"):
        parse_mix([])


def test_growing_a_mix_keeps_every_answered_request_id(tmp_path):
    """A source's file is a fixed shuffle cut to its share: a larger share only appends lines, so the request ids
    of a smaller run ("<stem>:<line>" -> the same prompt text) are all still there."""
    a = _prompts(tmp_path / "a.jsonl", 40, bad_lines={3})  # 39 valid prompts
    b = _prompts(tmp_path / "b.jsonl", 10)
    mix = parse_mix([f"{a}:30", str(b)])
    small = write_mix(mix, tmp_path / "mix", 0.2)
    rows_small, _ = read_prompt_files(small)
    big = write_mix(mix, tmp_path / "mix", 1.0)
    rows_big, skips = read_prompt_files(big)
    assert not skips
    by_id = {r.request_id: r.text for r in rows_big}
    assert all(by_id[r.request_id] == r.text for r in rows_small)
    counts = {stem: sum(r.request_id.startswith(stem + ":") for r in rows_big) for stem in ("a", "b")}
    assert counts == {"a": 30, "b": 10}
    assert {sum(r.request_id.startswith(s + ":") for r in rows_small) for s in ("a", "b")} == {6, 2}
    # the shuffle is a real one (not the file order) and the same every time
    assert [r.text for r in rows_big if r.request_id.startswith("a:")] != [f"question a {i}" for i in range(30)]
    write_mix(mix, tmp_path / "again", 1.0)
    assert (tmp_path / "again" / "a.jsonl").read_text() == (tmp_path / "mix" / "a.jsonl").read_text()
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        write_mix(mix, tmp_path / "mix", 0)


def test_budget_split_and_sizes():
    s = BudgetSplit()
    assert sum(s.seconds(3600).values()) == pytest.approx(3600)
    with pytest.raises(ValueError, match="sum to 1"):
        BudgetSplit(generate=0.5, extract=0.5, train=0.5, calibrate=0.1, evaluate=0.1)
    # stages 1-2's rounds: one round of 100 responses in 200 s -> 2 s per response, start-up included
    assert round_cost([(100, 200)]) == (0.0, 2.0)
    assert next_growth(600, [(100, 200)], 134, 10_000, min_rows=96) == 434
    assert next_growth(600, [(100, 200)], 134, 300, min_rows=96) == 300  # capped by the mix
    assert next_growth(100, [(100, 200)], 134, 10_000, min_rows=96) is None  # 50 more: less than a batch
    assert next_growth(100, [(100, 200)], 250, 300, min_rows=96) == 300  # the last 50 of the mix: worth a round
    assert next_growth(600, [(100, 200)], 300, 300, min_rows=96) is None  # the mix is answered
    assert next_growth(600, [(100, 200), (0, 150)], 134, 10_000, min_rows=96) is None  # a round added nothing
    assert next_growth(-30, [(100, 200)], 134, 10_000, min_rows=96) is None  # over budget
    # two rounds of different sizes separate the engines' start-up from the per-response cost (a measured run:
    # 34 responses in 220 s, then 77 in 302 s -> 155 s + 1.9 s per response); 186 s left fit 16 more, not a batch
    fixed, per_row = round_cost([(34, 220), (77, 302)])
    assert fixed == pytest.approx(155.2, abs=0.1) and per_row == pytest.approx(1.907, abs=0.001)
    assert next_growth(186, [(34, 220), (77, 302)], 111, 10_000, min_rows=32) is None
    assert next_growth(600, [(34, 220), (77, 302)], 111, 10_000, min_rows=32) == 111 + 233
    assert round_cost([(10, 100), (20, 50)]) == (0.0, 2.5)  # a line sloping down is noise: the last round's rate
    # training absorbs what stages 1-2 overran, down to half its planned share, and takes what they left unused
    assert training_seconds(1800, elapsed=2700, total=6300, reserved_after=1800) == 1800  # on time
    assert training_seconds(1800, elapsed=2200, total=6300, reserved_after=1800) == 2300
    assert training_seconds(1800, elapsed=3600, total=6300, reserved_after=1800) == 900  # 1000 s over: half left
    assert training_seconds(1800, elapsed=3400, total=6300, reserved_after=1800) == 1100
    assert training_seconds(1800, elapsed=6000, total=6300, reserved_after=1800) == 900  # never below the floor
    assert steps_that_fit(600, [2.0, 2.0]) == 150 and steps_that_fit(10, [2.0, 2.0], minimum=10) == 10
    assert steps_that_fit(600, [1.5, 0.5]) == 300  # equal steps, each drafter at its own step time
    with pytest.raises(ValueError, match="step time"):
        steps_that_fit(600, [2.0, 0])
    # the probe's step time: start-up before the first row is not a step; the interval after an evaluated row holds
    # the evaluation, whose extra time (here 12 s) is spread over --eval-every steps
    rows = [(5, 40.0), (10, 46.0), (15, 64.0), (20, 70.0)]
    assert probe_step_seconds(rows, {10, 20}, eval_every=50) == pytest.approx(1.2 + 12 / 50)
    assert probe_step_seconds(rows[:2] + [(15, 51.0), (20, 57.0)], {10, 20}, 50) == pytest.approx(1.2)  # free eval
    with pytest.raises(ValueError, match="with and without an evaluation"):
        probe_step_seconds(rows, set(), eval_every=50)
    with pytest.raises(ValueError, match="step order"):
        probe_step_seconds(rows[::-1], {10, 20}, eval_every=50)


def test_budget_reserves_what_fixed_size_stages_need():
    split = BudgetSplit()  # 0.40 / 0.07 / 0.28 / 0.05 / 0.20
    # needs below their fractions change nothing
    plan = plan_budget(split, 10_000, {"calibrate": 100, "evaluate": 1000})
    assert plan == pytest.approx(split.seconds(10_000))
    # an evaluation needing 4,000 s of 10,000: the other four share the 5,500 s left by their fractions
    plan = plan_budget(split, 10_000, {"calibrate": 100, "evaluate": 4000})
    assert plan["evaluate"] == 4000 and plan["calibrate"] == 500
    assert plan["generate"] == pytest.approx(5500 * 0.40 / 0.75) and sum(plan.values()) == pytest.approx(10_000)
    assert plan["generate"] / plan["train"] == pytest.approx(0.40 / 0.28)
    with pytest.raises(ValueError, match=r"too small: calibrate ~2 min, evaluate ~133 min leave 25 min"):
        plan_budget(split, 10_000, {"calibrate": 100, "evaluate": 8000})
    assert decode_seconds(1500, 15.0, slack=1.25) == pytest.approx(125.0) and decode_seconds(150, 15.0) > 10
    with pytest.raises(ValueError, match="decode rate"):
        decode_seconds(100, 0)


def test_recipe_usage_errors(tmp_path, capsys):
    from jobs.recipe import main

    for flags, msg in ((["--budget-hours", "0"], "budget-hours must be > 0"),
                       (["--eval-prompts", "0"], "eval-prompts must be >= 1"),
                       (["--split-train", "0.9"], "sum to 1"),
                       (["--eval-args", "--vllm-baselines float16"], "--vllm-baselines: ['float16']")):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "r"), *flags])
        assert msg in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        main(["--out", str(tmp_path / "r"), "--prompts", str(tmp_path / "nope.jsonl")])
    assert not (tmp_path / "r").exists()  # nothing is started or written before the inputs are checked
