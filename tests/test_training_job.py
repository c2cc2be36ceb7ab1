"""jobs.train on a real local Ray cluster (TorchTrainer, CPU): a tiny random Llama target, hidden states extracted
from it with the transformers extractor into a disk store (tests/tiny_training.py); resume after a preemption
continues with exactly the losses of an uninterrupted run; 2 workers (gloo all-reduce) train and export; the
single-process back end (--backend local) runs the same Trainer and matches the Ray path's losses."""
import json
import shutil
import time

import pytest
import torch

from jobs.train import main
from pipeline.dspark.checkpoint import load_drafter
from pipeline.train.metrics import read_learning_curve
from tiny_training import build_tiny_training_set, losses_by_step as _losses, preempt_and_resume, train_args as _args


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return build_tiny_training_set(tmp_path_factory.mktemp("tiny"))


def test_train_resume_is_exact(ray_session, tiny_setup, tmp_path):
    # W1 parameterised from the target embedding (--markov-w1 embedding): its projection is trained, checkpointed
    # and resumed like every other weight, and folded into the exported table (asserted at the end); the feature
    # noise is drawn from (seed, rank, step), so a resumed run draws the same
    opts = ("--markov-w1", "embedding", "--feature-noise", "0.1")
    main(_args(tiny_setup, tmp_path / "a", *opts))
    full = _losses(tmp_path / "a")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1]
    assert (tmp_path / "a" / "drafter" / "config.json").is_file() and (tmp_path / "a" / "loss_curve.png").is_file()
    # the preempted Ray run is also copied to x, finished below by the local back end
    preempt_and_resume(main, tiny_setup, tmp_path / "b", full, *opts,
                       between=lambda out: shutil.copytree(out, tmp_path / "x"))
    # the learning curve: held-out tau every --eval-every steps against supervised positions seen, which a resumed
    # run continues counting; the evaluation does not disturb training (the losses above match)
    curve_a = read_learning_curve(tmp_path / "a" / "metrics.jsonl")
    assert len(curve_a) == 3 and all(1.0 <= tau <= 8.0 for _, tau in curve_a)
    assert [x for x, _ in curve_a] == sorted({x for x, _ in curve_a}) and curve_a[0][0] > 0
    curve_b = read_learning_curve(tmp_path / "b" / "metrics.jsonl")
    assert [x for x, _ in curve_b] == [x for x, _ in curve_a]
    assert [t for _, t in curve_b] == pytest.approx([t for _, t in curve_a])
    # ... and next to it the replayed rounds' tau (--eval-walk-tokens, default 128), resumed exactly too
    walk_a = read_learning_curve(tmp_path / "a" / "metrics.jsonl", "heldout_walk_tau")
    walk_b = read_learning_curve(tmp_path / "b" / "metrics.jsonl", "heldout_walk_tau")
    assert [x for x, _ in walk_a] == [x for x, _ in curve_a] and all(1.0 <= tau <= 8.0 for _, tau in walk_a)
    assert [x for x, _ in walk_b] == [x for x, _ in walk_a]
    assert [t for _, t in walk_b] == pytest.approx([t for _, t in walk_a])
    assert (tmp_path / "a" / "learning_curve.png").is_file()
    # the exported drafter loads against its target
    d = load_drafter(tmp_path / "b" / "drafter", tiny_setup / "target")
    assert d.cfg.aux_layer_ids == [1, 2, 4] and d.cfg.kind == "dspark"
    # the single-process back end runs the same Trainer: the same losses as the Ray Train worker, step by step; and
    # it resumes the preempted Ray run's checkpoint (the same train_state.pt) exactly
    main(_args(tiny_setup, tmp_path / "l", "--backend", "local", "--device", "cpu", *opts))
    main(_args(tiny_setup, tmp_path / "x", "--backend", "local", "--device", "cpu", "--resume", *opts))
    for run in ("l", "x"):
        local = _losses(tmp_path / run)
        assert sorted(local) == sorted(full), run
        for step in range(1, 7):
            assert local[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), (run, step)


def test_train_two_workers_dflash(ray_session, tiny_setup, tmp_path, capfd):
    main(_args(tiny_setup, tmp_path / "c", "--workers", "2", "--drafter", "dflash", "--max-steps", "3"))
    # the workers' lines reach the driver through Ray's log monitor: each step line once, and none of Ray Train's
    # per-report INFO dumps (pipeline.train.ray_train.quiet_ray_train_reports)
    out, deadline = "", time.time() + 10
    while "exported drafter" not in out and time.time() < deadline:
        time.sleep(0.5)
        out += "".join(capfd.readouterr())
    assert "exported drafter" in out
    assert out.count("[train] step 3/3") == 1 and "Reporting training result" not in out
    losses = _losses(tmp_path / "c")
    assert sorted(losses) == [1, 2, 3] and all(v == v for v in losses.values())
    cfg = json.loads((tmp_path / "c" / "drafter" / "config.json").read_text())
    assert cfg["markov_rank"] == 0


def test_train_init_layers_from_target(tiny_setup, tmp_path):
    """--init-layers target: the run starts its 2 layers from the target's layers 2 and 3 and its final norm, so
    after one small step the exported layers are still within the step size of the target's; the default random
    init is nowhere near them.  (The random target's norms are all ones, like a fresh drafter's: the norms' copy is
    checked in tests/test_drafter.py.)"""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_setup / "target")
    common = ("--backend", "local", "--device", "cpu", "--max-steps", "1", "--eval-every", "0", "--lr", "1e-4",
              "--num-layers", "2")
    main(_args(tiny_setup, tmp_path / "t", *common, "--init-layers", "target"))
    main(_args(tiny_setup, tmp_path / "r", *common))
    for run, near in (("t", True), ("r", False)):
        d = load_drafter(tmp_path / run / "drafter", tiny_setup / "target")
        for j, i in ((0, 2), (1, 3)):
            diff = (d.layers[j].mlp.down_proj.weight - target.model.layers[i].mlp.down_proj.weight).abs().max()
            assert (float(diff) < 1e-3) == near, (run, j, float(diff))


def test_train_eval_data_curves_per_source_file(tiny_setup, tmp_path, capsys):
    """--eval-data: a second store (responses to other prompts, two source files) is measured at every held-out
    evaluation, per file, with both taus; the learning-curve benchmark reads them (--key eval_tau_<file>); a store
    of other layers, or one without a manifest, is refused with the reason."""
    from transformers import AutoModelForCausalLM

    from jobs.bench.learning_curves import run as curves_run
    from pipeline.data.hf_extractor import HFExtractor
    from pipeline.stores.disk import DiskHiddenStore

    def eval_store(folder, layers):
        ex = HFExtractor(tiny_setup / "target", layers)
        store = DiskHiddenStore(folder)
        g = torch.Generator().manual_seed(7)
        for tag in ("alpha", "beta"):
            for i in range(3):
                ids = torch.randint(3, 256, (30,), generator=g).tolist()
                aux, last = ex.extract(ids)
                store.put(f"{tag}:{i}", {"input_ids": torch.tensor(ids, dtype=torch.int32), "aux_hidden": aux,
                                         "loss_mask": torch.tensor([0] * 8 + [1] * 22, dtype=torch.uint8),
                                         "last_hidden": last})
        store.commit({"layer_ids": layers, "target": str(tiny_setup / "target")})
        return folder

    good = eval_store(tmp_path / "bench", [1, 2, 4])
    main(_args(tiny_setup, tmp_path / "run", "--backend", "local", "--device", "cpu", "--max-steps", "2",
               "--eval-data", str(good)))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_tau_alpha" in r]
    assert [r["step"] for r in evals] == [2]
    for key in ("eval_tau_alpha", "eval_tau_beta", "eval_walk_tau_alpha", "eval_walk_tau_beta"):
        assert 1.0 <= evals[0][key] <= 8.0, key
    assert "beta replayed tau" in capsys.readouterr().out

    class A:  # the benchmark's parsed arguments
        runs, png, title, x, key = [f"r={tmp_path / 'run'}"], tmp_path / "c.png", None, "positions", "eval_tau_beta"
    got = curves_run(A, None)["runs"]["r"]
    assert got["eval_tau_beta"][0][1] == pytest.approx(evals[0]["eval_tau_beta"]) and (tmp_path / "c.png").is_file()
    assert got["eval_walk_tau_beta"][0][1] == pytest.approx(evals[0]["eval_walk_tau_beta"])

    # jobs.bench heldout_tau --data: the exported drafter on the same store gives the last evaluation's numbers
    from jobs.bench.harness import Harness
    from jobs.bench.heldout_tau import run as tau_run

    class B:
        drafters, split_of, data, blocks, walk_tokens, limit = ([f"r={tmp_path / 'run' / 'drafter'}"], None, good,
                                                                64, 128, 0)
    res = tau_run(B, Harness("heldout_tau", tmp_path / "tau", ["t"]))["drafters"]["r"]
    for tag in ("alpha", "beta"):
        assert res[tag]["tau"] == pytest.approx(evals[0][f"eval_tau_{tag}"], rel=1e-5)
        assert res["walk"][tag] == pytest.approx(evals[0][f"eval_walk_tau_{tag}"], rel=1e-5)

    # jobs.bench domain_share: the same taus, against each suite's domain share of the run's training samples
    from jobs.bench.domain_share import run as share_run

    train_ids = json.loads((tmp_path / "run" / "plan.json").read_text())["train_ids"]

    class C:
        runs, data, walk_tokens, blocks, limit, png = [f"r={tmp_path / 'run'}"], good, 128, 64, 0, tmp_path / "s.png"
        domain = ["alpha=s0,s1,nowhere", "beta=" + ",".join(train_ids)]
    row = share_run(C, Harness("domain_share", tmp_path / "share", ["t"]))["runs"][0]
    assert row["share"] == pytest.approx({"alpha": len({"s0", "s1"} & set(train_ids)) / len(train_ids), "beta": 1.0})
    for tag in ("alpha", "beta"):
        assert row["walk_tau"][tag] == pytest.approx(evals[0][f"eval_walk_tau_{tag}"], rel=1e-5)
    assert (tmp_path / "s.png").stat().st_size > 0
    C.domain = ["gamma=s0"]
    with pytest.raises(SystemExit, match="no such suite in --data"):
        share_run(C, Harness("domain_share", tmp_path / "share", ["t"]))

    other = eval_store(tmp_path / "other", [1, 2, 3])
    with pytest.raises(ValueError, match=r"holds layers \[1, 2, 3\].*--layer-ids 1,2,4"):
        main(_args(tiny_setup, tmp_path / "bad", "--backend", "local", "--device", "cpu", "--max-steps", "2",
                   "--eval-data", str(other)))
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_setup, tmp_path / "bad2", "--eval-data", str(tmp_path / "nothing")))
    assert e.value.code == 2 and "not a finished disk store" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_train_on_a_gpu_worker(ray_session, tiny_setup, tmp_path):
    """--gpus-per-worker 1: a Ray Train GPU worker (use_gpu, NCCL process group, bf16 autocast) trains, checkpoints,
    exports; a preempted run resumes."""
    gpu = ("--gpus-per-worker", "1", "--bf16", "true")
    main(_args(tiny_setup, tmp_path / "g", *gpu, "--stop-after", "3"))
    assert sorted(_losses(tmp_path / "g")) == [1, 2, 3]
    main(_args(tiny_setup, tmp_path / "g", *gpu, "--resume"))
    assert sorted(_losses(tmp_path / "g")) == [1, 2, 3, 4, 5, 6]
    load_drafter(tmp_path / "g" / "drafter", tiny_setup / "target")


def test_train_workers_listen_on_loopback_only(ray_session, tmp_path):
    """The gradient all-reduce's rendezvous store and gloo sockets bind loopback (stock TorchConfig's store listens
    on every interface: ':::port', measured)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.train.ray_train import LoopbackTorchConfig

    def all_reduce_and_report_listeners(config):  # defined here: the workers get it by value, not by module name
        import json
        from pathlib import Path

        import psutil
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        mine = sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                       if c.status == psutil.CONN_LISTEN})
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)  # while the process group (store, gloo pairs) is up
        if dist.get_rank() == 0:
            Path(config["out"]).write_text(json.dumps({"sum": t.item(), "listeners": gathered}))

    out = tmp_path / "listeners.json"
    result = TorchTrainer(all_reduce_and_report_listeners, train_loop_config={"out": str(out)},
                          torch_config=LoopbackTorchConfig(),
                          scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
                          run_config=RunConfig(name="listen", storage_path=str(tmp_path))).fit()
    report = json.loads(out.read_text())
    assert result.error is None and report["sum"] == 2.0
    listeners = report["listeners"]
    assert len(listeners) == 2 and all(listeners), listeners  # rank 0 hosts the store, both have gloo pairs
    assert all(_is_loopback(addr) for rank in listeners for addr in rank), listeners


def _is_loopback(addr: str) -> bool:
    """'127.0.0.1:123', '::ffff:127.0.0.1:123' (IPv4-mapped) or '::1:123' -> True; '0.0.0.0:123', ':::123' -> False."""
    import ipaddress

    ip = ipaddress.ip_address(addr.rsplit(":", 1)[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


@pytest.mark.parametrize("flag,value,message", [("--feature-noise", "-0.1", "--feature-noise must be >= 0"),
                                                ("--lr", "0", "--lr must be > 0"),
                                                ("--holdout-frac", "1.5", "--holdout-frac must be in [0, 1)")])
def test_train_rejects_bad_numbers_before_starting(tmp_path, capsys, flag, value, message):
    """Nonsense numbers are a usage error naming the flag, raised before Ray starts or --out is touched."""
    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
