"""Stage 1 - regenerate the target's responses to a set of prompts (Ray Data + an actor pool of vLLM generators).

Writes Parquet shards (request id, source file, prompt/response token ids, loss mask, finish reason) and, last,
manifest.json.  Resumable and exactly-once: rerun the same command after a crash and only the missing rows are
generated.  Prompts that are malformed, empty or too long are recorded in skipped.parquet, not fatal."""
from __future__ import annotations

from pipeline.runtime import apply_env, reexec_for_process_env


def main(argv=None):
    apply_env()
    from actors.generation import GenerateConfig, run_generation
    from pipeline.config_cli import parse_config

    cfg = parse_config(GenerateConfig, argv, description=__doc__)
    manifest = run_generation(cfg)
    print(f"[generate] done: {cfg.out} ({manifest.get('num_rows', 0)} rows, complete={manifest.get('complete')})")
    return manifest


if __name__ == "__main__":
    reexec_for_process_env()  # start-only settings (malloc tunables) for this process too
    main()
