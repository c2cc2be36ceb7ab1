"""Where one drafter training step spends its time, in one process without Ray (the same functions as
jobs.train's worker loop: plan, step_sample_ids, step_blocks, accumulate_gradients, clip, fused AdamW).

    .venv/bin/python scripts/profile_train_step.py --data work/big/hidden --steps 12

Prints supervised positions/s over the steps after --skip warm-up steps with the time share of fetch / blocks /
forward+backward / clip / optimizer, then a torch.profiler table of one more step (top operators by self CPU).
Compare with the positions/s `jobs.train` logs on the same store to see what the Ray job adds."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="work/hidden", help="disk hidden-state store (stage 2 output)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the totals")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="dspark", choices=["dspark", "dflash"])
    a = ap.parse_args()

    from pipeline.runtime import apply_env

    apply_env()
    from pipeline.target_weights import load_target_weights
    from pipeline.dspark.drafter import DSparkDrafter
    from pipeline.dspark.losses import LossConfig, TargetHead
    from pipeline.training import (TrainConfig, accumulate_gradients, build_drafter_config, open_store, plan,
                                   step_blocks, step_sample_ids)

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = TrainConfig(data=Path(a.data), out=Path("/tmp/profile_train_step"), drafter=a.drafter)
    p = plan(cfg)
    target = Path(p["target"])
    draft_ids = torch.tensor(p["draft_ids"]) if p["draft_ids"] is not None else None
    dcfg = build_drafter_config(cfg, target, p["layer_ids"], len(p["draft_ids"] or []) or None)
    model = DSparkDrafter.from_target(dcfg, target, draft_ids=draft_ids)
    params = model.trainable_parameters()
    loss_cfg = LossConfig(kind=cfg.drafter, distance=cfg.distance, decay=cfg.decay_value())
    head = TargetHead(load_target_weights(target).lm_head, model.draft_ids)
    opt = torch.optim.AdamW(params, lr=cfg.lr, fused=True)
    store = open_store(cfg)
    print(f"{sum(x.numel() for x in params) / 1e6:.1f}M trainable parameters, draft vocab "
          f"{len(p['draft_ids'] or [])}, {len(p['train_ids'])} training samples")

    def one_step(step):
        t = [time.perf_counter()]
        samples = [store.get(i) for i in step_sample_ids(p["train_ids"], step, cfg.seqs_per_step, 1, 0, cfg.seed)]
        t.append(time.perf_counter())
        blocks, wsum = step_blocks(samples, cfg.num_anchors, cfg.block_size, loss_cfg.decay, cfg.seed, 0, step)
        t.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        _, n_sup, _ = accumulate_gradients(model, head, samples, blocks, loss_cfg, max(wsum, 1e-12),
                                           cfg.micro_batch)
        t.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        return [t1 - t0 for t0, t1 in zip(t, t[1:])], n_sup

    parts = dict.fromkeys(("fetch", "blocks", "forward+backward", "clip", "optimizer"), 0.0)
    npos = 0
    for step in range(a.steps):
        dts, n = one_step(step)
        if step >= a.skip:
            for k, dt in zip(parts, dts):
                parts[k] += dt
            npos += n
    total = sum(parts.values())
    print(f"{npos / total:.0f} supervised positions/s over {a.steps - a.skip} steps; "
          + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in parts.items()))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_step(a.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    store.close()


if __name__ == "__main__":
    from pipeline.runtime import reexec_for_process_env

    reexec_for_process_env()
    main()
