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

    from pipeline.checkpoint import export_checkpoint
    from pipeline.drafter import DSparkDrafter
    from pipeline.drafter_config import DrafterConfig

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

    from pipeline.scheduler import CostTable

    cost = tmp_path / "cost.json"
    CostTable({1: 0.040, 8: 0.055, 64: 0.15}).save(cost)
    res = main(["--drafter", f"dspark={smol_drafter}", "--benchmarks", str(bench_file), "--limit", "2",
                "--max-new-tokens", "12", "--out", str(tmp_path), "--target", str(target_dir),
                "--also-schedulers", "hardware", "--cost-table", str(cost)])
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


def test_calibrate_writes_temperatures(smol_drafter, bench_file, target_dir, tmp_path):
    from jobs.calibrate import main
    from pipeline.checkpoint import read_config

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

    from pipeline.evaluation import plot_reliability

    png = tmp_path / "reliability.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_reliability({"dspark": [{"rounds": []}]}, [("dspark", 7)], png)
    assert png.stat().st_size > 1000
