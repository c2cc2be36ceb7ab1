"""jobs.train --fsdp (pipeline/train/fsdp.py): the drafter sharded over 2 Ray Train CPU workers (gloo) with FSDP2
trains exactly like the replicated (DDP-equivalent) run on the same data - the same losses and the same gradient
norms, so the gradients are summed over the workers, not averaged - writes the same checkpoint (format and
values), resumes after a preemption exactly, and exports a drafter that loads; --backend local --fsdp is a usage
error; the dry run shows the strategy."""
import json
import time

import pytest
import torch

from jobs.train import main
from pipeline.dspark.checkpoint import load_drafter
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.losses import LossConfig, TargetHead
from pipeline.stores import DiskHiddenStore
from pipeline.dspark.target_weights import load_target_weights
from pipeline.train.config import STATE_FILE, TrainConfig, build_drafter_config
from pipeline.train.step import accumulate_gradients, step_blocks
from tiny_training import build_tiny_training_set, preempt_and_resume, train_args

TWO_WORKERS = ("--workers", "2", "--markov-w1", "embedding", "--feature-noise", "0.1")


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return build_tiny_training_set(tmp_path_factory.mktemp("tiny"))


def _rows(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _checkpoint_at(out, step: int) -> dict:
    """The train_state.pt of step `step` among a Ray run's kept checkpoints."""
    for f in (out / "ray").rglob(STATE_FILE):
        state = torch.load(f, weights_only=False, map_location="cpu")
        if state["step"] == step:
            return state
    raise AssertionError(f"no checkpoint of step {step} under {out / 'ray'}")


def _assert_same_state(a, b, path="state"):
    """Nested dicts / lists of tensors and plain values: equal, tensors of the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same_state(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_fsdp_matches_ddp_resumes_and_exports(ray_session, tiny_setup, tmp_path, capfd):
    """The replicated run, then an --fsdp run preempted after step 3 and resumed: step by step the losses and
    gradient norms of the replicated run (so FSDP sums the gradients: an average would halve the norm), and at
    step 3 the same checkpoint."""
    main(train_args(tiny_setup, tmp_path / "ddp", *TWO_WORKERS))
    ddp = _rows(tmp_path / "ddp")
    assert sorted(ddp) == [1, 2, 3, 4, 5, 6] and max(r["grad_norm"] for r in ddp.values()) > 1.0  # clipping acts

    def same_checkpoint(out):  # full state dicts, the optimizer's keyed by parameter index: either resumes either
        _assert_same_state(_checkpoint_at(out, 3), _checkpoint_at(tmp_path / "ddp", 3))

    preempt_and_resume(main, tiny_setup, tmp_path / "fsdp", {k: r["loss"] for k, r in ddp.items()}, *TWO_WORKERS,
                       "--fsdp", between=same_checkpoint)
    fsdp = _rows(tmp_path / "fsdp")
    for step in ddp:
        for key in ("grad_norm", "supervised_positions", "positions_seen"):
            assert fsdp[step][key] == pytest.approx(ddp[step][key], rel=1e-5, abs=1e-7), (step, key)
        if "heldout_tau" in ddp[step]:
            assert fsdp[step]["heldout_tau"] == pytest.approx(ddp[step]["heldout_tau"]), step
    out, deadline = "", time.time() + 10  # the workers' lines reach the driver through Ray's log monitor
    while "exported drafter" not in out and time.time() < deadline:
        time.sleep(0.5)
        out += "".join(capfd.readouterr())
    assert "FSDP: " in out and "sharded over 2 worker(s)" in out, out[-2000:]
    # the exported drafter (gathered on rank 0) loads with the project's loader and holds the trained weights
    ref = load_drafter(tmp_path / "ddp" / "drafter", tiny_setup / "target")
    d = load_drafter(tmp_path / "fsdp" / "drafter", tiny_setup / "target")
    assert d.cfg.aux_layer_ids == [1, 2, 4] and d.cfg.kind == "dspark"
    assert list(d.state_dict()) == list(ref.state_dict())
    for (name, p), q in zip(d.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name


def test_padding_passes_add_nothing(tiny_setup):
    """accumulate_gradients' min_chunks (with --fsdp every rank runs as many forward/backward passes as the busiest
    one): the extra zero-weight passes leave the loss parts and gradients exactly as they were; a rank without any
    supervised sequence cannot pad and says so."""
    cfg = TrainConfig(markov_rank=16)
    drafter = DSparkDrafter.from_target(build_drafter_config(cfg, tiny_setup / "target", [1, 2, 4], None),
                                        tiny_setup / "target")
    head = TargetHead(load_target_weights(tiny_setup / "target").lm_head, drafter.draft_ids)
    store = DiskHiddenStore(tiny_setup / "hidden")
    samples = [store.get(f"s{i}") for i in range(3)]
    loss_cfg = LossConfig()
    blocks, wsum = step_blocks(samples, 8, cfg.block_size, loss_cfg.decay, 0, 0, 0)
    results = []
    for min_chunks in (0, 5):  # 2 real micro-batches of 2, then 3 padding passes
        drafter.zero_grad(set_to_none=True)
        parts, n_sup, acc = accumulate_gradients(drafter, head, samples, blocks, loss_cfg, wsum, micro_batch=2,
                                                 min_chunks=min_chunks)
        results.append((parts, n_sup, acc, {n: p.grad.clone() for n, p in drafter.named_parameters()
                                            if p.grad is not None}))
    (p0, n0, a0, g0), (p1, n1, a1, g1) = results
    assert p1 == p0 and n1 == n0 > 0 and torch.equal(a1, a0) and list(g1) == list(g0) and g0
    assert all(torch.equal(g1[k], g0[k]) for k in g0)
    unsupervised = [s | {"loss_mask": torch.zeros_like(s["loss_mask"])} for s in samples[:1]]
    none, _ = step_blocks(unsupervised, 8, cfg.block_size, loss_cfg.decay, 0, 0, 0)
    with pytest.raises(RuntimeError, match="no sequence of this rank has a supervised block"):
        accumulate_gradients(drafter, head, unsupervised, none, loss_cfg, 1.0, micro_batch=2, min_chunks=1)


def test_fsdp_with_the_local_backend_is_rejected(tmp_path, capsys):
    """One process has no process group to shard over: a usage error naming the flag, before --out is touched."""
    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--backend", "local", "--fsdp"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--fsdp" in err and "--backend local" in err
    assert not (tmp_path / "run").exists()


def test_dry_run_shows_the_data_parallel_strategy(tiny_setup, tmp_path, capsys):
    def dry(*extra):
        return main(["--data", str(tiny_setup / "hidden"), "--out", str(tmp_path / "run"), "--target",
                     str(tiny_setup / "target"), "--workers", "2", "--cpus-per-worker", "1", "--dry-run", *extra])

    sharded, replicated = dry("--fsdp"), dry()
    assert sharded["trainer"]["fsdp"] is True and replicated["trainer"]["fsdp"] is False
    assert sharded["data_parallel"]["strategy"] == "fsdp" and replicated["data_parallel"]["strategy"] == "ddp"
    assert "reduce-scatter" in sharded["data_parallel"]["gradients"]
    assert sharded["ray"]["scaling_config"] == replicated["ray"]["scaling_config"]  # the same workers
    local = main(["--data", str(tiny_setup / "hidden"), "--out", str(tmp_path / "run"), "--target",
                  str(tiny_setup / "target"), "--backend", "local", "--device", "cpu", "--dry-run"])
    assert local["data_parallel"] is None and local["trainer"]["fsdp"] is False
    assert not (tmp_path / "run").exists()
