"""jobs.evaluate and jobs.calibrate on the real SmolLM2 target with a (random-weight) DSpark drafter exported in the
checkpoint format: results are produced for every system, greedy speculative output equals the baseline's token
for token, STS temperatures are fitted and written into the checkpoint."""
import json

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_drafter(target_dir, tmp_path_factory):
    from transformers import AutoConfig

    from pipeline.dspark.checkpoint import export_checkpoint
    from pipeline.dspark.drafter import DSparkDrafter
    from pipeline.dspark.config import DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target_dir), num_hidden_layers=1,
                                           draft_vocab_size=4096, markov_rank=32)
    ids = torch.arange(4096)  # any strictly increasing subset of target ids
    d = DSparkDrafter.from_target(cfg, target_dir, draft_ids=ids)
    with torch.no_grad():  # make the heads non-trivial (they start at zero)
        d.markov_head.markov_w2.weight.normal_(0, 0.02)
        d.confidence_head.proj.weight.normal_(0, 0.5)
    return export_checkpoint(d, tmp_path_factory.mktemp("drafter") / "drafter", verifier_name_or_path=str(target_dir))


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("bench") / "mini.jsonl"
    f.write_text("\n".join(json.dumps({"turns": [t]}) for t in
                           ["What is 3 + 4?", "Write a Python function that doubles a number.", "Say hello."]) + "\n")
    return f


def test_evaluate_side_by_side_lossless(smol_drafter, bench_file, target_dir, tmp_path):
    from jobs.evaluate import main

    from pipeline.core.config_cli import parse_config
    from pipeline.eval.evaluation import EvalConfig, planned_systems
    from pipeline.engine.cost_table import CostTable

    cost = tmp_path / "cost.json"
    CostTable({1: 0.040, 8: 0.055, 64: 0.15}).save(cost)
    flags = ["--drafter", f"dspark={smol_drafter}", "--benchmarks", str(bench_file), "--limit", "2",
             "--max-new-tokens", "12", "--out", str(tmp_path), "--target", str(target_dir),
             "--also-schedulers", "hardware", "--cost-table", str(cost), "--vllm-baselines", "none"]
    res = main(flags)
    # the recipe sizes the evaluation's budget from these names, before any drafter exists
    assert res["systems"] == planned_systems(parse_config(EvalConfig, flags), [("dspark", True)])
    o = res["overall"]
    assert set(o) == {"baseline-float32", "baseline-float32:packed", "baseline-float32:mkl", "baseline-bfloat16", "dspark",
                      "dspark@hardware"}
    assert res["scheduler_of"] == {"dspark": "fixed", "dspark@hardware": "hardware"}
    assert o["dspark@hardware"]["greedy_mismatches_vs_baseline"] == 0
    assert o["dspark@hardware"]["mean_verified_depth"] <= o["dspark"]["mean_verified_depth"]
    s = o["dspark"]
    assert s["greedy_mismatches_vs_baseline"] == 0
    assert s["rounds"] > 0 and 1.0 <= s["tau"] <= 8.0
    assert len(s["cumulative_acceptance"]) == 7 and s["mean_verified_depth"] > 0
    assert res["benchmarks"]["mini"]["dspark"]["generated_tokens"] == s["generated_tokens"]
    assert max(o[n]["speedup_vs_fastest_baseline"] for n in o if n.startswith("baseline")) == pytest.approx(1.0)
    for png in ("acceptance_by_position.png", "reliability.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["fastest_baseline"].startswith("baseline")
    c = res["bias_cache"]["dspark"]  # the vanilla head's step biases: 7 lookups per drafted row
    assert 7 * (s["rounds"] - 2) <= c["hits"] + c["misses"] and c["misses"] > 0
    assert c["hits"] > 0 and c["hit_rate"] == pytest.approx(c["hits"] / (c["hits"] + c["misses"]))


def test_calibrate_writes_temperatures(smol_drafter, bench_file, target_dir, tmp_path):
    from jobs.calibrate import main
    from pipeline.dspark.checkpoint import read_config

    r = main(["--drafter", str(smol_drafter), "--prompts", str(bench_file), "--limit", "3", "--max-new-tokens", "24",
              "--batch", "3", "--out", str(tmp_path), "--target", str(target_dir)])
    assert len(r["sts_temperatures"]) == 7 and r["rounds"] >= 10
    assert sum(r["after"]["ece"]) <= sum(r["before"]["ece"]) + 1e-9
    assert read_config(smol_drafter).sts_temperatures == pytest.approx(r["sts_temperatures"])
    assert (tmp_path / "reliability.png").is_file() and (tmp_path / "calibration.json").is_file()


def test_reliability_plot_without_full_depth_rounds_says_so(tmp_path):
    """Under an adaptive scheduler no round verifies all gamma drafts: the diagram is written with a note, and
    matplotlib has no empty legend to warn about."""
    import warnings

    from pipeline.eval.evaluation import plot_reliability

    png = tmp_path / "reliability.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_reliability({"dspark": [{"rounds": []}]}, [("dspark", 7)], png)
    assert png.stat().st_size > 1000


def _training_run_with_holdout(tmp_path, prompt_ids: dict[str, list[int]], holdout: list[str]):
    """A training run folder as jobs.train leaves it (plan.json naming the held-out ids and the hidden-state store,
    whose manifest names the responses folder) over a small responses store."""
    import pyarrow as pa

    from pipeline.data.shards import ShardSet

    resp = tmp_path / "responses"
    ShardSet(resp, "request_id").write_shard(pa.table({
        "request_id": list(prompt_ids), "prompt_ids": [list(v) for v in prompt_ids.values()]}))
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "manifest.json").write_text(json.dumps({"stage": "hidden_states", "responses": str(resp)}))
    run = tmp_path / "train"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"holdout_ids": holdout, "config": {"data": str(hidden)}}))
    return run, resp


def test_heldout_suites_group_by_source_file_and_find_their_responses(tmp_path):
    from pipeline.eval.sts_rollouts import CalibrateConfig, heldout_prompts
    from pipeline.eval.evaluation import load_heldout_suites

    ids = {f"{tag}:{i}": [i, i + 1, i + 2] for tag in ("math", "code") for i in range(1, 6)}
    run, resp = _training_run_with_holdout(tmp_path, ids, ["math:2", "math:4", "code:1", "code:3", "code:5"])
    suites = dict(load_heldout_suites(run, None, limit=20))  # responses found through the hidden-state manifest
    assert set(suites) == {"heldout-math", "heldout-code"}
    assert {r["id"] for r in suites["heldout-math"]} == {"math:2", "math:4"}
    assert suites["heldout-code"][0]["prompt_ids"] == ids[suites["heldout-code"][0]["id"]]
    # jobs.calibrate finds the same responses by default (drafter inside the run folder)
    assert heldout_prompts(CalibrateConfig(drafter=run / "drafter", limit=5)) == [
        ids[i] for i in ("math:2", "math:4", "code:1", "code:3", "code:5")]
    capped = dict(load_heldout_suites(run, resp, limit=2))
    assert len(capped["heldout-code"]) == 2 and set(r["id"] for r in capped["heldout-code"]) < {"code:1", "code:3",
                                                                                             "code:5"}


def test_heldout_subsets_draw_from_every_source_file(tmp_path):
    """"At most N held-out samples" (calibration's --limit, the learning curve's --eval-samples) is a fixed seeded
    subset, not the first N of the store's order or of the sorted ids, which would all come from one prompt file."""
    from pipeline.eval.sts_rollouts import CalibrateConfig, heldout_prompts
    from pipeline.train.dataset import heldout_eval_ids

    ids = {f"{tag}:{i}": [k, i] for k, tag in enumerate(("arena", "math")) for i in range(10, 30)}
    run, _ = _training_run_with_holdout(tmp_path, ids, list(ids))
    picked = heldout_prompts(CalibrateConfig(drafter=run / "drafter", limit=8))
    assert len(picked) == 8 and {p[0] for p in picked} == {0, 1}  # both files
    assert len({tuple(p) for p in picked}) == 8
    assert heldout_prompts(CalibrateConfig(drafter=run / "drafter", limit=8)) == picked  # the same every time
    curve = heldout_eval_ids(list(ids), 8)
    assert len(set(curve)) == 8 and {i.split(":")[0] for i in curve} == {"arena", "math"}
    assert heldout_eval_ids(list(reversed(list(ids))), 8) == curve  # independent of the plan's order
    assert sorted(heldout_eval_ids(list(ids), 100)) == sorted(ids)


def test_heldout_suites_name_what_is_missing(tmp_path):
    from pipeline.eval.evaluation import EvalConfig, load_heldout_suites, run_evaluation

    with pytest.raises(FileNotFoundError, match="plan.json missing"):
        load_heldout_suites(tmp_path, None, 8)
    run, resp = _training_run_with_holdout(tmp_path, {"a:1": [1, 2]}, ["b:7"])
    with pytest.raises(ValueError, match="none of the 1 held-out samples"):
        load_heldout_suites(run, resp, 8)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_heldout_suites(run, tmp_path / "nowhere", 8)
    assert not (tmp_path / "nowhere").exists()  # a reader creates nothing
    (run / "plan.json").write_text(json.dumps({"holdout_ids": ["a:1"], "config": {"data": str(tmp_path / "gone")}}))
    with pytest.raises(FileNotFoundError, match="pass --responses"):
        load_heldout_suites(run, None, 8)
    with pytest.raises(ValueError, match="only applies with --heldout-of"):
        run_evaluation(EvalConfig(responses=resp, out=tmp_path / "eval"))
    (run / "plan.json").write_text(json.dumps({"holdout_ids": []}))
    with pytest.raises(ValueError, match="no held-out samples"):
        load_heldout_suites(run, resp, 8)


def test_evaluate_on_a_training_runs_heldout_prompts(smol_drafter, target_dir, tmp_path):
    """--heldout-of alone evaluates the run's held-out prompts (real chat-templated ids), one suite per source."""
    from transformers import AutoTokenizer

    from jobs.evaluate import main
    from pipeline.data.prompts import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    texts = {"math:1": "What is 3 + 4?", "math:2": "What is 5 * 6?", "code:1": "Write hello world in Python."}
    run, _ = _training_run_with_holdout(tmp_path, {k: chat_prompt_ids(tok, t) for k, t in texts.items()},
                                        ["math:2", "code:1"])
    res = main(["--drafter", f"dspark={smol_drafter}", "--heldout-of", str(run), "--max-new-tokens", "6",
                "--baseline-dtypes", "float32", "--vllm-baselines", "float32", "--out", str(tmp_path / "eval"),
                "--target", str(target_dir)])
    assert set(res["benchmarks"]) == {"heldout-math", "heldout-code"}
    assert res["overall"]["dspark"]["prompts"] == 2 and res["overall"]["dspark"]["greedy_mismatches_vs_baseline"] == 0
    # vLLM's plain decoding ran on the same prompts as a further no-speculation system, and the fastest of all
    # no-speculation systems is the reference of every speedup
    v = res["overall"]["vllm-float32"]
    assert v["prompts"] == 2 and 0 < v["generated_tokens"] <= 2 * 6 and v["tokens_per_s"] > 0
    plain = {n: s for n, s in res["overall"].items() if n.startswith(("baseline-", "vllm-"))}
    assert res["fastest_baseline"] in plain
    assert max(s["speedup_vs_fastest_baseline"] for s in plain.values()) == pytest.approx(1.0)
    with pytest.raises(SystemExit):  # a precision vLLM baselines do not take is a usage error
        main(["--heldout-of", str(run), "--vllm-baselines", "float16", "--out", str(tmp_path / "e2")])


def test_a_scheduler_named_twice_runs_once():
    """The recipe adds --also-schedulers hardware; a user's --eval-args naming it again must not run it twice."""
    from pipeline.core.config_cli import parse_config
    from pipeline.eval.evaluation import EvalConfig, planned_systems

    cfg = parse_config(EvalConfig, ["--scheduler", "fixed", "--also-schedulers", "hardware", "--also-schedulers",
                                    "hardware", "fixed", "--vllm-baselines", "none"])
    names = planned_systems(cfg, [("dspark", True), ("dflash", False)])
    assert [n for n in names if not n.startswith("baseline-")] == ["dspark", "dspark@hardware", "dflash"]


def test_drafter_dtype_follows_a_bf16_target_where_bf16_is_native(monkeypatch):
    """--drafter-dtype auto: bf16 only with a bf16 verification target on a device with native bf16."""
    import pipeline.eval.evaluation as ev

    monkeypatch.setattr(ev, "cpu_has_native_bf16", lambda: True)
    assert ev.resolve_drafter_dtype("auto", "bfloat16:packed", "cpu") == torch.bfloat16
    assert ev.resolve_drafter_dtype("auto", "float32:packed", "cpu") == torch.float32
    assert ev.resolve_drafter_dtype("float32", "bfloat16", "cpu") == torch.float32
    monkeypatch.setattr(ev, "cpu_has_native_bf16", lambda: False)
    assert ev.resolve_drafter_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert ev.resolve_drafter_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert ev.resolve_drafter_dtype("bfloat16", "float32", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="--drafter-dtype"):
        ev.resolve_drafter_dtype("fp16", "float32", "cpu")
