"""Plot held-out tau against supervised positions seen for one or more training runs on one figure.

    python scripts/plot_learning_curves.py dspark=work/big/curve_dspark dflash=work/big/curve_dflash \
        --out docs/results/learning_curve_446.png

Each argument is LABEL=RUN (a jobs.train --out folder or its metrics.jsonl); runs must have been trained with
--eval-every > 0 (the default).  Prints the curve points too: teacher-forced tau, and the replayed rounds' tau
(dashed in the plot) for runs trained with --eval-walk-tokens > 0."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    from pipeline.training import plot_learning_curves, read_learning_curve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=RUN_FOLDER or LABEL=metrics.jsonl")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    runs = {}
    for spec in a.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"expected LABEL=RUN, got {spec!r}")
        path = Path(path)
        runs[label] = path / "metrics.jsonl" if path.is_dir() else path
        if not runs[label].is_file():
            p.error(f"{label}: no metrics file at {runs[label]}")
    for label, path in runs.items():
        walk = dict(read_learning_curve(path, "heldout_walk_tau"))  # {positions seen: replayed tau}
        points = [f"{x / 1e6:.3f}M -> {t:.3f}" + (f" (replayed {walk[x]:.3f})" if x in walk else "")
                  for x, t in read_learning_curve(path)]
        print(f"{label}: " + ", ".join(points))
    if not plot_learning_curves(runs, a.out, a.title):
        raise SystemExit("no run has held-out tau rows (train with --eval-every > 0)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
