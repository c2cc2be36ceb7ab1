"""Stage 1 - regenerate the target's responses to a set of prompts (Ray Data + an actor pool of vLLM generators).

Writes Parquet shards (request id, source file, prompt/response token ids, loss mask, finish reason) and, last,
manifest.json.  Resumable and exactly-once: rerun the same command after a crash and only the missing rows are
generated.  Prompts that are malformed, empty or too long are recorded in skipped.parquet, not fatal.

On GPUs (each actor one GPU of an inference node; one actor over N GPUs with --tensor-parallel-size N):
    python -m jobs.generate --pool-size 2 --gpus-per-actor 1 --gpu-memory-utilization 0.9 --max-num-seqs 256
--dry-run prints the Ray resources and the vLLM engine configuration as JSON and starts nothing."""
from __future__ import annotations

from actors.generation import GenerateConfig, generation_plan, run_generation
from pipeline.core.config_cli import parse_config
from pipeline.launch.launch_plan import print_plan
from pipeline.core.runtime import apply_env, run_job_main
from pipeline.data.target_model import resolve_target


def main(argv=None):
    apply_env()
    cfg = parse_config(GenerateConfig, argv, description=__doc__)
    if cfg.dry_run:
        return print_plan(generation_plan(cfg, resolve_target(cfg.target)))
    manifest = run_generation(cfg)
    print(f"[generate] done: {cfg.out} ({manifest.get('num_rows', 0)} rows, complete={manifest.get('complete')})")
    return manifest


if __name__ == "__main__":
    run_job_main(main)
