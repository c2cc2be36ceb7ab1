"""Stage 4 - calibrate the drafter's confidence head with Sequential Temperature Scaling (docs/dspark.md §4).

Rolls out the real speculative engine (fixed full-length verification, raw confidences) on the training run's
held-out prompts, fits one temperature per position left to right (grid search on the ECE of the cumulative
product), stores them in the checkpoint, and writes calibration.json (ECE / AUC / Brier per position before and
after) and reliability.png."""
from __future__ import annotations

from pipeline.core.runtime import apply_env, run_job_main


def main(argv=None):
    apply_env()
    from pipeline.core.config_cli import parse_config
    from pipeline.eval.sts_rollouts import CalibrateConfig

    return run(parse_config(CalibrateConfig, argv, description=__doc__))


def run(cfg):
    """Calibrate as ``cfg`` (a CalibrateConfig) says and print the per-position report."""
    from pipeline.eval.sts_rollouts import run_calibration

    r = run_calibration(cfg)
    print(f"[calibrate] {r['rounds']} full-length rounds from {r['prompts']} prompts; temperatures "
          + ", ".join(f"{t:.2f}" for t in r["sts_temperatures"]))
    print(f"{'k':>2} {'ECE before':>10} {'ECE after':>10} {'AUC':>6} {'Brier b/a':>14}")
    for k in range(len(r["sts_temperatures"])):
        b, a = r["before"], r["after"]
        print(f"{k + 1:>2} {b['ece'][k]:10.4f} {a['ece'][k]:10.4f} {a['auroc'][k]:6.3f} "
              f"{b['brier'][k]:6.4f}/{a['brier'][k]:6.4f}")
    return r


if __name__ == "__main__":
    run_job_main(main)
