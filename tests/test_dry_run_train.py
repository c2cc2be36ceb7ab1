"""jobs.train --dry-run (the Ray resources, torch back end, dtype and trainer configuration that would be launched,
printed as JSON without starting Ray) for a CPU layout and a GPU layout, and --backend local (the same Trainer in
one process, no Ray): it trains, exports a drafter that loads, writes checkpoints in the Ray path's format and
resumes exactly."""
import json
import os
import subprocess
import sys

import pytest
import torch

from jobs.train import main
from pipeline.dspark.checkpoint import load_drafter
from pipeline.core.runtime import PROJECT_ROOT
from pipeline.data.shards import ShardSet
from pipeline.stores import DiskHiddenStore
from pipeline.train.config import LOCAL_CHECKPOINTS, STATE_FILE
from pipeline.train.metrics import latest_checkpoint, read_learning_curve
from tiny_training import build_tiny_training_set, losses_by_step, preempt_and_resume, train_args


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return build_tiny_training_set(tmp_path_factory.mktemp("tiny"))


def _dry_args(root, out, *extra):
    return ["--data", str(root / "hidden"), "--out", str(out), "--target", str(root / "target"),
            "--seqs-per-step", "2", "--cpus-per-worker", "1", "--dry-run", *extra]


def _dry_run_in_fresh_process(argv: list[str]) -> tuple[dict, list[str]]:
    """jobs.train.main(argv) in a new interpreter -> (the JSON it printed, the heavy modules it imported)."""
    code = ("import json, sys\nfrom jobs.train import main\nmain(json.loads(sys.argv[1]))\n"
            "print(json.dumps(sorted(m for m in ('ray', 'vllm', 'mooncake') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=240, env=os.environ | {"DSPARK_NO_REEXEC": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    *spec_lines, imported = proc.stdout.strip().splitlines()
    return json.loads("\n".join(spec_lines)), json.loads(imported)


def test_dry_run_cpu_layout(tiny_setup, tmp_path, capsys):
    """Two CPU workers: gloo, fp32, 1 CPU each, and a training slot each where the cluster declares training nodes
    (the auto rule; '{}' switches it off); the step count comes from the store's manifest."""
    spec = main(_dry_args(tiny_setup, tmp_path / "run", "--workers", "2", "--bf16", "false", "--max-steps", "6"))
    assert json.loads(capsys.readouterr().out) == spec  # what it prints is what it returns
    assert spec["job"] == "train" and spec["backend"] == "ray"
    ray = spec["ray"]
    assert ray["scaling_config"] == {"num_workers": 2, "use_gpu": False,
                                     "resources_per_worker": {"CPU": 1.0, "training": 1.0}}
    assert ray["placement"] == {"role": "training", "rule": "auto", "resources": {"training": 1.0},
                                "applies_when": "the cluster declares 'training'", "otherwise": {}}
    assert ray["total"] == {"num_cpus": 2.0, "num_gpus": 0.0, "resources": {"training": 2.0}}
    assert ray["torch_config"]["backend"] == "gloo"
    assert ray["run_config"]["storage_path"] == str((tmp_path / "run" / "ray").resolve())
    assert spec["torch"] == {"device": "cpu", "process_group": "gloo", "master_weights": "float32",
                             "autocast": None, "threads_per_worker": 1}
    assert spec["trainer"]["workers"] == 2 and spec["trainer"]["seqs_per_step"] == 2
    data = spec["data"]
    assert data["samples"] == 12 and data["train_samples"] + data["holdout_samples"] == 12
    assert data["layer_ids"] == [1, 2, 4] and data["seqs_per_step_all_workers"] == 4 and data["total_steps"] == 6
    assert not (tmp_path / "run").exists()  # nothing written
    unplaced = main(_dry_args(tiny_setup, tmp_path / "run", "--workers", "2", "--worker-resources", "{}"))["ray"]
    assert unplaced["placement"] == {"role": "training", "rule": "explicit", "resources": {}}
    assert unplaced["scaling_config"]["resources_per_worker"] == {"CPU": 1.0}


def test_dry_run_gpu_layout_without_ray(tiny_setup, tmp_path):
    """One training node with 2 GPUs (ray start --num-gpus 2 --resources '{"training": 2}'): 2 GPU workers, one GPU
    and one training slot each, NCCL, bf16 autocast - printed by a process that never imports Ray."""
    argv = _dry_args(tiny_setup, tmp_path / "run", "--workers", "2", "--gpus-per-worker", "1", "--epochs", "3")
    spec, imported = _dry_run_in_fresh_process(argv)
    assert imported == []
    ray = spec["ray"]
    assert ray["scaling_config"] == {"num_workers": 2, "use_gpu": True,
                                     "resources_per_worker": {"CPU": 1.0, "GPU": 1.0, "training": 1.0}}
    assert ray["total"] == {"num_cpus": 2.0, "num_gpus": 2.0, "resources": {"training": 2.0}}
    assert ray["placement"]["rule"] == "auto"
    assert ray["torch_config"]["backend"] == "nccl"
    assert spec["torch"]["process_group"] == "nccl" and spec["torch"]["autocast"] == "bfloat16"
    assert spec["torch"]["device"].startswith("cuda") and spec["torch"]["master_weights"] == "float32"
    # 3 epochs over the training samples at 2 sequences x 2 workers per step
    assert spec["data"]["total_steps"] == -(-3 * spec["data"]["train_samples"] // 4)
    # --bf16 false overrides the CUDA default
    spec, _ = _dry_run_in_fresh_process(argv + ["--bf16", "false"])
    assert spec["torch"]["autocast"] is None


def test_dry_run_local_backend(tiny_setup, tmp_path, capsys):
    spec = main(_dry_args(tiny_setup, tmp_path / "run", "--backend", "local", "--device", "cpu", "--max-steps", "6"))
    assert spec["ray"] is None and spec["backend"] == "local"
    assert spec["torch"]["device"] == "cpu" and spec["torch"]["process_group"] is None
    assert spec["torch"]["autocast"] is None and spec["data"]["total_steps"] == 6


def test_local_backend_trains_and_resumes_exactly(tiny_setup, tmp_path):
    """--backend local: the Trainer in this process. A run preempted after step 3 (--stop-after) and resumed ends
    with exactly the losses and held-out taus of an uninterrupted one; its checkpoints (the newest two, in Ray's
    train_state.pt format) load, and so does the exported drafter."""
    opts = ("--backend", "local", "--device", "cpu", "--markov-w1", "embedding", "--feature-noise", "0.1")
    main(train_args(tiny_setup, tmp_path / "a", *opts))
    full = losses_by_step(tmp_path / "a")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1]
    assert not (tmp_path / "a" / "ray").exists() and (tmp_path / "a" / "loss_curve.png").is_file()
    ckpts = sorted(p.name for p in (tmp_path / "a" / LOCAL_CHECKPOINTS).iterdir())
    assert ckpts == ["step_00000003", "step_00000006"]
    state = torch.load(latest_checkpoint(tmp_path / "a") / STATE_FILE, weights_only=False)
    assert state["step"] == 6 and state["positions_seen"] > 0
    assert {"model", "optimizer", "scheduler", "drafter_config", "draft_ids"} <= set(state)

    def preempted(out):
        assert latest_checkpoint(out).name == "step_00000003"

    preempt_and_resume(main, tiny_setup, tmp_path / "b", full, *opts, between=preempted)
    curve_a = read_learning_curve(tmp_path / "a" / "metrics.jsonl")
    curve_b = read_learning_curve(tmp_path / "b" / "metrics.jsonl")
    assert len(curve_a) == 3 and [x for x, _ in curve_b] == [x for x, _ in curve_a]
    assert [t for _, t in curve_b] == pytest.approx([t for _, t in curve_a])

    d = load_drafter(tmp_path / "b" / "drafter", tiny_setup / "target")
    assert d.cfg.aux_layer_ids == [1, 2, 4] and d.cfg.kind == "dspark"
    # the resumed run's export equals the uninterrupted run's
    a = load_drafter(tmp_path / "a" / "drafter", tiny_setup / "target").state_dict()
    for k, v in d.state_dict().items():
        torch.testing.assert_close(v, a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_local_backend_time_budget_checkpoints_and_resumes(tiny_setup, tmp_path):
    """--max-seconds ends a run after the first step past the budget, checkpointed; --resume finishes it."""
    main(train_args(tiny_setup, tmp_path / "c", "--backend", "local", "--drafter", "dflash", "--max-seconds", "1e-6",
                    "--eval-every", "0"))
    assert sorted(losses_by_step(tmp_path / "c")) == [1] and not (tmp_path / "c" / "drafter").exists()
    assert latest_checkpoint(tmp_path / "c").name == "step_00000001"
    main(train_args(tiny_setup, tmp_path / "c", "--backend", "local", "--drafter", "dflash", "--resume",
                    "--eval-every", "0"))
    assert sorted(losses_by_step(tmp_path / "c")) == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "c" / "drafter" / "config.json").read_text())["markov_rank"] == 0


@pytest.mark.parametrize("extra,message", [
    (("--backend", "local", "--workers", "2"), "--backend local trains in one process: --workers must be 1"),
    (("--gpus-per-worker", "-1"), "--gpus-per-worker must be >= 0"),
    (("--backend", "local", "--gpus-per-worker", "1"), "--backend local takes --device instead"),
    (("--device", "cuda"), "--device is for --backend local"),
    (("--max-seconds", "0"), "--max-seconds must be > 0"),
    (("--max-steps", "0"), "--max-steps must be > 0")])
def test_train_rejects_bad_layouts(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_local_backend_runs_stages_one_and_two_in_process(target_dir, tmp_path):
    """--backend local --prompts on the real target: greedy responses (transformers) and their hidden states in this
    process, written in the stage formats (responses Parquet, a disk store naming them), then a short training run
    on them; a second call reuses the finished store."""
    args = ["--backend", "local", "--device", "cpu", "--prompts", str(PROJECT_ROOT / "pipeline/data/assets/"
                                                                      "miniature_prompts.jsonl"),
            "--limit-per-file", "5", "--max-new-tokens", "12", "--gen-batch", "5", "--target", str(target_dir),
            "--data", str(tmp_path / "hidden"), "--out", str(tmp_path / "run"), "--num-layers", "1",
            "--markov-rank", "16", "--max-steps", "2", "--seqs-per-step", "2", "--num-anchors", "4",
            "--eval-every", "0", "--log-every", "1", "--holdout-frac", "0.2", "--cpus-per-worker", "2"]
    main(args)
    responses = ShardSet(tmp_path / "run" / "responses", key="request_id")
    rows = list(responses.iter_rows(["request_id", "response_ids", "finish_reason"]))
    assert len(rows) == 5 and all(1 <= len(r["response_ids"]) <= 12 for r in rows)
    store = DiskHiddenStore(tmp_path / "hidden")
    manifest = store.manifest()
    assert sorted(manifest["sample_ids"]) == sorted(r["request_id"] for r in rows)
    assert manifest["responses"] == str(tmp_path / "run" / "responses") and manifest["extractor"] == "hf"
    sample = store.get(manifest["sample_ids"][0])
    assert sample["aux_hidden"].shape[1] == manifest["aux_dim"] == 3 * manifest["hidden_size"]
    assert sample["target_lse"] is not None and int(sample["loss_mask"].sum()) >= 1
    assert sorted(losses_by_step(tmp_path / "run")) == [1, 2]
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    before = (tmp_path / "hidden" / "manifest.json").stat().st_mtime_ns
    main(args)  # the store is finished: trained again, not extracted again
    assert (tmp_path / "hidden" / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_local_backend_on_cuda_resumes_and_matches_cpu(tiny_setup, tmp_path):
    """--backend local --device cuda (bf16 autocast by default): it trains and exports; a run preempted after step
    3 and resumed matches the uninterrupted one (CUDA kernels may add in another order: close, not bitwise); in
    fp32 (--bf16 false) the losses are those of the CPU run."""
    cuda = ("--backend", "local", "--device", "cuda")
    main(train_args(tiny_setup, tmp_path / "g", *cuda, "--bf16", "true"))
    full = losses_by_step(tmp_path / "g")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1]
    main(train_args(tiny_setup, tmp_path / "h", *cuda, "--bf16", "true", "--stop-after", "3"))
    main(train_args(tiny_setup, tmp_path / "h", *cuda, "--bf16", "true", "--resume"))
    resumed = losses_by_step(tmp_path / "h")
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(full[step], rel=1e-3), step
    load_drafter(tmp_path / "h" / "drafter", tiny_setup / "target")
    main(train_args(tiny_setup, tmp_path / "f", *cuda))  # train_args: --bf16 false
    main(train_args(tiny_setup, tmp_path / "c", "--backend", "local", "--device", "cpu"))
    on_gpu, on_cpu = losses_by_step(tmp_path / "f"), losses_by_step(tmp_path / "c")
    for step in range(1, 7):
        assert on_gpu[step] == pytest.approx(on_cpu[step], rel=1e-3), step


def test_mix_trains_on_chosen_sources_and_counts():
    """--mix SOURCE[:COUNT]: only those sources, each source's training ids cut to COUNT by a fixed seeded subset (a
    larger COUNT keeps the smaller one's ids); held-out ids from the same sources; bad entries name the problem."""
    from pipeline.data.subsets import cut_to_mix, parse_mix
    from pipeline.train.config import TrainConfig
    from pipeline.train.dataset import split_ids, training_split

    ids = [f"{tag}:{i}" for tag in ("math", "code", "chat") for i in range(1, 41)]
    assert parse_mix(["math:10", "chat"]) == {"math": 10, "chat": None}
    small = cut_to_mix(ids, {"math": 5, "chat": 3})
    assert sum(i.startswith("math:") for i in small) == 5 and sum(i.startswith("chat:") for i in small) == 3
    assert not any(i.startswith("code:") for i in small)
    assert set(small) < set(cut_to_mix(ids, {"math": 10, "chat": 6}))  # nested: shares differ only by count
    assert small == [i for i in ids if i in set(small)]  # the store's order is kept
    assert small != [i for i in ids if i.startswith("math:")][:5] + [i for i in ids if i.startswith("chat:")][:3]

    cfg = TrainConfig(mix=["code:12", "chat"], holdout_frac=0.1)
    train, hold = training_split(ids, cfg)
    all_train, all_hold = split_ids(ids, 0.1)
    assert sum(i.startswith("code:") for i in train) == 12
    assert {i for i in train if i.startswith("chat:")} == {i for i in all_train if i.startswith("chat:")}
    assert set(hold) == {i for i in all_hold if not i.startswith("math:")} and hold
    assert not set(train) & set(hold)

    for bad, says in ((["math:0"], "COUNT must be > 0"), (["math:x"], "COUNT must be an integer"),
                      (["math", "math:3"], "names 'math' twice"), ([":3"], "expected SOURCE")):
        with pytest.raises(ValueError, match=says):
            TrainConfig(mix=bad)
    with pytest.raises(ValueError, match=r"--mix poetry: no samples from that source; the data holds chat \(40\)"):
        cut_to_mix(ids, {"poetry": 1})
    with pytest.raises(ValueError, match="--mix math:41: only 40 training samples"):
        cut_to_mix(ids, {"math": 41})


def test_dry_run_counts_the_mix(tiny_setup, tmp_path, capsys):
    """The dry run's data summary is the mixed data set's (the tiny store's ids s0..s11 are each their own source)."""
    data = main(_dry_args(tiny_setup, tmp_path / "run", "--mix", "s0", "s1", "s2", "s3", "--holdout-frac", "0",
                          "--epochs", "1"))["data"]
    capsys.readouterr()
    assert data["train_samples"] == 4 and data["holdout_samples"] == 0 and data["total_steps"] == 2
