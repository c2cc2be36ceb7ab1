"""What a training run writes besides its checkpoints: metrics.jsonl rows, the loss and learning-curve plots, and
where its latest checkpoint is.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from pipeline.train.config import LOCAL_CHECKPOINTS, STATE_FILE


def metrics_row(step: int, lr: float, grad_norm: float, positions: int, seconds: float, n_sup: int, parts: dict,
                acc: torch.Tensor, positions_seen: int | None = None) -> dict:
    """One metrics.jsonl row (pipeline.train.trainer.Trainer logs it on every back end; plot_metrics reads them).
    positions / seconds: supervised positions since the last row and the wall time they took; positions_seen: all
    supervised positions trained on so far (all ranks, kept across --resume)."""
    row = dict(step=step, lr=lr, grad_norm=grad_norm, positions_per_s=positions / max(seconds, 1e-9),
               supervised_positions=n_sup, **parts, acc_top1_first=float(acc[0] / max(1, n_sup)), time=time.time())
    if positions_seen is not None:
        row["positions_seen"] = positions_seen
    return row


def append_metrics(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def plot_metrics(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if "positions_per_s" in r:
            rows[r["step"]] = r
    if not rows:
        return
    steps = sorted(rows)
    keys = [k for k in ("loss", "ce", "dist", "conf") if k in rows[steps[0]]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, k in zip(axes if len(keys) > 1 else [axes], keys):
        ax.plot(steps, [rows[s][k] for s in steps])
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def read_learning_curve(metrics_path: Path, key: str = "heldout_tau", x: str = "positions") -> list[tuple]:
    """[(supervised positions seen, held-out tau)] of a run's metrics.jsonl, by step (a resumed run's rows for the
    same step replace the earlier ones).  key: heldout_tau (teacher-forced, averaged over positions) or
    heldout_walk_tau (greedy rounds replayed along the responses, tokens per round as the engine counts).
    x="seconds": the first element is the run's training seconds up to that step instead (`training_seconds`)."""
    rows, seconds = {}, training_seconds(metrics_path) if x == "seconds" else None
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if key in r and "positions_seen" in r and not math.isnan(r[key]):
            rows[r["step"]] = (int(r["positions_seen"]) if seconds is None else seconds[r["step"]], float(r[key]))
    return [rows[k] for k in sorted(rows)]


def training_seconds(metrics_path: Path) -> dict[int, float]:
    """{step: seconds spent training up to that step} of a run's metrics.jsonl: each row's positions since the row
    before divided by its positions_per_s (which leaves the held-out evaluations out), summed; comparable across
    runs of different drafter sizes as tau at equal training wall time."""
    rows = {}
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if "positions_seen" in r and "positions_per_s" in r:
            rows[r["step"]] = (int(r["positions_seen"]), float(r["positions_per_s"]))
    out, seen, total = {}, 0, 0.0
    for step in sorted(rows):
        pos, rate = rows[step]
        total += max(0, pos - seen) / max(rate, 1e-9)
        seen, out[step] = pos, total
    return out


def walk_key(key: str) -> str:
    """The replayed-rounds metric beside a teacher-forced one: heldout_tau -> heldout_walk_tau, eval_tau_<file> ->
    eval_walk_tau_<file>."""
    return key.replace("_tau", "_walk_tau", 1)


def plot_learning_curves(runs: dict[str, Path], png: Path, title: str | None = None, x: str = "positions",
                         key: str = "heldout_tau") -> bool:
    """Held-out greedy tau against supervised positions seen (x="seconds": training seconds), one colour per run
    {label: metrics.jsonl}: the teacher-forced tau solid, the replayed rounds' tau (where logged) dashed.  key:
    heldout_tau, or eval_tau_<file> for --eval-data's.  Returns False (no file written) when no run has that
    metric."""
    curves = {k: read_learning_curve(v, key, x=x) for k, v in runs.items()}
    walks = {k: read_learning_curve(v, walk_key(key), x=x) for k, v in runs.items()}
    curves = {k: c for k, c in curves.items() if c}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, c in curves.items():
        line, = ax.plot([x for x, _ in c], [y for _, y in c], marker="o", ms=3, label=f"{label} (teacher-forced)")
        if walks[label]:
            ax.plot([x for x, _ in walks[label]], [y for _, y in walks[label]], marker="o", ms=3, ls="--",
                    color=line.get_color(), label=f"{label} (replayed rounds)")
    ax.set_xlabel("supervised positions seen" if x == "positions" else "training seconds (evaluations left out)")
    ax.set_ylabel("held-out greedy tau (depth = block size)" if key == "heldout_tau"
                  else f"greedy tau on {key.removeprefix('eval_tau_')} (depth = block size)")
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder of a run (by the step stored inside): Ray Train's under run_dir/ray or the local
    back end's under run_dir/checkpoints (the same STATE_FILE, so either back end resumes either's checkpoint)."""
    best, best_step = None, -1
    found = [f for sub in ("ray", LOCAL_CHECKPOINTS) for f in Path(run_dir, sub).rglob(STATE_FILE)]
    for f in found:
        if f.parent.name.endswith(".partial"):  # a local checkpoint whose copy did not finish
            continue
        try:
            step = torch.load(f, weights_only=False, map_location="cpu")["step"]
        except Exception:  # a checkpoint being written when the run died
            continue
        if step > best_step:
            best, best_step = f.parent, step
    return best
