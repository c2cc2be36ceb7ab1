"""jobs.train on a real local Ray cluster (TorchTrainer, CPU): a tiny random Llama target, hidden states extracted
from it with the transformers extractor into a disk store; resume after a preemption continues with exactly the
losses of an uninterrupted run; 2 workers (gloo all-reduce) train and export."""
import json

import pytest
import torch

from pipeline.stores.disk import DiskHiddenStore
from pipeline.hf_extractor import HFExtractor


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "target")
    from pipeline.stores.base import full_vocab_lse

    ex = HFExtractor(root / "target", [1, 2, 4])
    store = DiskHiddenStore(root / "hidden", samples_per_shard=4)
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        T = 40 + 3 * i
        ids = torch.randint(3, 256, (T,), generator=g).tolist()
        aux, last = ex.extract(ids)
        mask = torch.tensor([0] * 10 + [1] * (T - 10), dtype=torch.uint8)
        sample = {"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": mask, "aux_hidden": aux,
                  "last_hidden": last}
        if i % 2:  # half the samples carry the cached full-vocabulary lse (both training paths run)
            sample["target_lse"] = full_vocab_lse(last, model.lm_head.weight)
        store.put(f"s{i}", sample)
    store.commit({"layer_ids": [1, 2, 4], "target": str(root / "target")})
    return root


def _losses(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _args(root, out, *extra):
    return ["--data", str(root / "hidden"), "--out", str(out), "--target", str(root / "target"),
            "--max-steps", "6", "--seqs-per-step", "2", "--num-anchors", "8", "--checkpoint-every", "3",
            "--log-every", "1", "--holdout-frac", "0.1", "--cpus-per-worker", "1", "--bf16", "false",
            "--markov-rank", "16", "--eval-every", "2", *extra]


def test_train_resume_is_exact(ray_session, tiny_setup, tmp_path):
    from jobs.train import main
    from pipeline.training import read_learning_curve

    # W1 parameterised from the target embedding (--markov-w1 embedding): its projection is trained, checkpointed
    # and resumed like every other weight, and folded into the exported table (asserted at the end); the feature
    # noise is drawn from (seed, rank, step), so a resumed run draws the same
    opts = ("--markov-w1", "embedding", "--feature-noise", "0.1")
    main(_args(tiny_setup, tmp_path / "a", *opts))
    full = _losses(tmp_path / "a")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and full[6] < full[1]
    assert (tmp_path / "a" / "drafter" / "config.json").is_file() and (tmp_path / "a" / "loss_curve.png").is_file()
    main(_args(tiny_setup, tmp_path / "b", "--stop-after", "3", *opts))
    assert sorted(_losses(tmp_path / "b")) == [1, 2, 3] and not (tmp_path / "b" / "drafter").exists()
    main(_args(tiny_setup, tmp_path / "b", "--resume", *opts))
    resumed = _losses(tmp_path / "b")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
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
    from pipeline.dspark.checkpoint import load_drafter

    d = load_drafter(tmp_path / "b" / "drafter", tiny_setup / "target")
    assert d.cfg.aux_layer_ids == [1, 2, 4] and d.cfg.kind == "dspark"


def test_train_two_workers_dflash(ray_session, tiny_setup, tmp_path, capfd):
    import time

    from jobs.train import main

    main(_args(tiny_setup, tmp_path / "c", "--workers", "2", "--drafter", "dflash", "--max-steps", "3"))
    # the workers' lines reach the driver through Ray's log monitor: each step line once, and none of Ray Train's
    # per-report INFO dumps (pipeline.training.quiet_ray_train_reports)
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


def test_train_workers_listen_on_loopback_only(ray_session, tmp_path):
    """The gradient all-reduce's rendezvous store and gloo sockets bind loopback (stock TorchConfig's store listens
    on every interface: ':::port', measured)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.train_backend import LoopbackTorchConfig

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
    from jobs.train import main

    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), flag, value])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
