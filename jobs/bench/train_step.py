"""Where one drafter training step spends its time, in one process without Ray (the same functions as
jobs.train's worker loop: plan, step_sample_ids, step_blocks, accumulate_gradients, clip, fused AdamW).

    python -m jobs.bench train_step --data work/big/hidden --steps 12 [--device cuda]

Prints supervised positions/s over the steps after --skip warm-up steps with the time share of fetch / blocks /
forward+backward / clip / optimizer, then a torch.profiler table of one more step (top operators by self CPU).
Compare with the positions/s `jobs.train` logs on the same store to see what the Ray job adds."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.losses import LossConfig, TargetHead
from pipeline.core.runtime import resolve_device
from pipeline.dspark.target_weights import load_target_weights
from pipeline.train.config import TrainConfig, build_drafter_config, use_bf16_autocast
from pipeline.train.step import accumulate_gradients, step_blocks
from pipeline.train.dataset import open_store, plan, step_sample_ids

NAME = "train_step"
HELP = "time shares of one drafter training step (fetch / blocks / fwd+bwd / clip / optimizer), no Ray, + profile"

PARTS = ("fetch", "blocks", "forward+backward", "clip", "optimizer")


def add_arguments(ap) -> None:
    ap.add_argument("--data", default="work/hidden", help="disk hidden-state store (stage 2 output)")
    ap.add_argument("--steps", type=int, default=12, help="steps in all, warm-up included")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the totals")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="dspark", choices=["dspark", "dflash"])
    ap.add_argument("--profile-rows", type=int, default=15, help="operators in the torch.profiler table")
    ap.add_argument("--seqs-per-step", type=int, default=8, help="sequences per step (jobs.train's flag)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward (jobs.train's flag)")
    ap.add_argument("--device", default="cpu", help="torch device: cpu, cuda, auto (bf16 autocast on CUDA, as "
                    "jobs.train's --bf16 default); each part is timed after a device synchronisation")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft vocabulary size (jobs.train's flag; default: 99%% coverage of the store's tokens)")
    ap.add_argument("--bf16", choices=["auto", "true", "false"], default="auto",
                    help="bf16 autocast: auto = jobs.train's default (CUDA, or a CPU that measures it faster)")


def run(a, harness) -> dict:
    if not 0 <= a.skip < a.steps:
        raise SystemExit(f"--skip must be in [0, --steps), got --skip {a.skip} --steps {a.steps}")
    if not Path(a.data).is_dir():
        raise SystemExit(f"--data {a.data}: no such hidden-state store folder")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = TrainConfig(data=Path(a.data), out=harness.out_dir / "train", drafter=a.drafter,
                      seqs_per_step=a.seqs_per_step, micro_batch=a.micro_batch,
                      bf16=None if a.bf16 == "auto" else a.bf16 == "true", draft_vocab_size=a.draft_vocab_size)
    device = torch.device(resolve_device(a.device))
    bf16 = use_bf16_autocast(cfg, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    p = plan(cfg)
    target = Path(p["target"])
    draft_ids = torch.tensor(p["draft_ids"]) if p["draft_ids"] is not None else None
    dcfg = build_drafter_config(cfg, target, p["layer_ids"], len(p["draft_ids"] or []) or None)
    model = DSparkDrafter.from_target(dcfg, target, draft_ids=draft_ids).to(device)
    params = model.trainable_parameters()
    loss_cfg = LossConfig(kind=cfg.drafter, distance=cfg.distance, decay=cfg.decay_value())
    head = TargetHead(load_target_weights(target).lm_head.to(device), model.draft_ids)
    opt = torch.optim.AdamW(params, lr=cfg.lr, fused=True)
    store = open_store(cfg)
    n_params = sum(x.numel() for x in params)
    print(f"{n_params / 1e6:.1f}M trainable parameters, draft vocab "
          f"{len(p['draft_ids'] or [])}, {len(p['train_ids'])} training samples, on {device}"
          + (" (bf16 autocast)" if bf16 else ""))

    def one_step(step):
        sync()
        t = [time.perf_counter()]
        samples = [store.get(i) for i in step_sample_ids(p["train_ids"], step, cfg.seqs_per_step, 1, 0, cfg.seed)]
        t.append(time.perf_counter())
        blocks, wsum = step_blocks(samples, cfg.num_anchors, cfg.block_size, loss_cfg.decay, cfg.seed, 0, step)
        t.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        _, n_sup, _ = accumulate_gradients(model, head, samples, blocks, loss_cfg, max(wsum, 1e-12),
                                           cfg.micro_batch, bf16=bf16, device=device)
        sync()
        t.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        sync()
        t.append(time.perf_counter())
        opt.step()
        sync()
        t.append(time.perf_counter())
        return {"positions": n_sup, **{k: t1 - t0 for k, t0, t1 in zip(PARTS, t, t[1:])}}

    try:
        s = harness.interleave({"step": one_step}, a.steps - a.skip, warmup=a.skip, label="steps")
        parts = {k: s.total("step", k) for k in PARTS}
        npos = s.total("step", "positions")
        total = sum(parts.values())
        print(f"{npos / total:.0f} supervised positions/s over {a.steps - a.skip} steps; "
              + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in parts.items()))
        harness.table(f"training step parts over {a.steps - a.skip} steps",
                      ["part", "seconds", "share", "median ms per step"],
                      [[k, f"{v:.2f}", f"{100 * v / total:.1f}%", f"{s.median('step', k) * 1e3:.1f}"]
                       for k, v in parts.items()])
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            one_step(a.steps)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile_rows))
    finally:
        store.close()
    return {"data": str(a.data), "drafter": a.drafter, "device": str(device), "bf16": bf16,
            "trainable_params": n_params,
            "positions_per_s": npos / total, "part_seconds": parts,
            "part_share": {k: v / total for k, v in parts.items()}}
