"""Plot held-out tau against supervised positions seen for one or more training runs on one figure.

    python -m jobs.bench learning_curves dspark=work/big/curve_dspark dflash=work/big/curve_dflash \\
        --png docs/results/learning_curve_446.png

Each argument is LABEL=RUN (a jobs.train --out folder or its metrics.jsonl); runs must have been trained with
--eval-every > 0 (the default).  Prints the curve points too: teacher-forced tau, and the replayed rounds' tau
(dashed in the plot) for runs trained with --eval-walk-tokens > 0.  The PNG defaults to <out>/learning_curves.png.
--x seconds puts training seconds on the x axis instead (tau at equal wall time, for drafters of different sizes;
runs compared this way should have shared the machine alike, e.g. run side by side)."""
from __future__ import annotations

from pathlib import Path

from pipeline.train.metrics import plot_learning_curves, read_learning_curve, walk_key

NAME = "learning_curves"
HELP = "plot (and print) held-out tau vs supervised positions seen for one or more training runs"


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", help="LABEL=RUN_FOLDER or LABEL=metrics.jsonl")
    p.add_argument("--png", type=Path, default=None, help="PNG to write (default: <out>/learning_curves.png)")
    p.add_argument("--title", default=None)
    p.add_argument("--x", choices=["positions", "seconds"], default="positions",
                   help="x axis: supervised positions seen, or training seconds (evaluations left out)")
    p.add_argument("--key", default="heldout_tau",
                   help="the curve: heldout_tau (the run's held-out split) or eval_tau_<file> (jobs.train "
                        "--eval-data's samples from that prompt file, e.g. eval_tau_gsm8k)")


def run(a, harness) -> dict:
    if "_walk_tau" in a.key:
        raise SystemExit(f"--key {a.key}: name the teacher-forced curve ({a.key.replace('_walk_tau', '_tau', 1)}); "
                         "its replayed-rounds curve is drawn beside it, dashed")
    runs = {}
    for spec in a.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"expected LABEL=RUN, got {spec!r}")
        path = Path(path)
        runs[label] = path / "metrics.jsonl" if path.is_dir() else path
        if not runs[label].is_file():
            raise SystemExit(f"{label}: no metrics file at {runs[label]}")
    curves = {}
    for label, path in runs.items():
        walk = dict(read_learning_curve(path, walk_key(a.key), x=a.x))  # {positions seen | seconds: replayed tau}
        curve = read_learning_curve(path, a.key, x=a.x)
        fmt = (lambda v: f"{v / 1e6:.3f}M") if a.x == "positions" else (lambda v: f"{v:.0f}s")
        points = [f"{fmt(x)} -> {t:.3f}" + (f" (replayed {walk[x]:.3f})" if x in walk else "") for x, t in curve]
        print(f"{label}: " + ", ".join(points))
        curves[label] = {"metrics": str(path), "x": a.x, a.key: [[x, t] for x, t in curve],
                         walk_key(a.key): [[x, t] for x, t in walk.items()]}
    png = a.png or harness.out_dir / "learning_curves.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    if not plot_learning_curves(runs, png, a.title, x=a.x, key=a.key):
        raise SystemExit(f"no run has {a.key} rows (train with --eval-every > 0"
                         + (", and --eval-data for eval_tau_<file>)" if a.key != "heldout_tau" else ")"))
    print(f"wrote {png}")
    return {"png": str(png), "runs": curves}
