"""Stage 2 - extract the target's hidden states for every response (Ray Data + vLLM extractor actors).

For each stage-1 row (prompt + response) stores: token ids, loss mask, the chosen target layers concatenated (bf16)
and the final hidden state before the LM head (bf16), in Parquet shards on disk (--store disk) or in a Mooncake
store (--store mooncake; the job starts a mooncake_master on 127.0.0.1 and stops it unless --mooncake-master names
a running one).  Resumable: stored samples are skipped; the manifest is written last.

On GPUs (one extractor per GPU; Mooncake over RDMA with the CUDA Mooncake build):
    python -m jobs.extract --pool-size 2 --gpus-per-actor 1 --store mooncake --mooncake-protocol rdma
--dry-run prints the Ray resources, the vLLM engine configuration and the store as JSON and starts nothing."""
from __future__ import annotations

from actors.extraction import ExtractConfig, extraction_plan, run_extraction
from pipeline.core.config_cli import parse_config
from pipeline.launch.launch_plan import PlanError, print_plan
from pipeline.core.runtime import apply_env, run_job_main
from pipeline.data.target_model import resolve_target


def main(argv=None):
    apply_env()
    cfg = parse_config(ExtractConfig, argv, description=__doc__)
    if cfg.mooncake_master and not cfg.mooncake_metadata:
        raise SystemExit("--mooncake-master needs --mooncake-metadata (the master's metadata server URL)")
    try:
        plan = extraction_plan(cfg, resolve_target(cfg.target))
    except PlanError as e:  # a combination only the installed packages can rule out (e.g. rdma without its build)
        raise SystemExit(f"extract: error: {e}") from None
    if cfg.dry_run:
        return print_plan(plan)
    if cfg.store == "mooncake":
        from actors.mooncake_master import MooncakeMaster

        if cfg.mooncake_master:
            endpoint = MooncakeMaster.connect(cfg.mooncake_master, cfg.mooncake_metadata)
            manifest = run_extraction(cfg, endpoint)
        else:
            print("[extract] starting a mooncake_master on 127.0.0.1 for this job (its data lives as long as the "
                  "job; use --mooncake-master to keep it, e.g. `python -m actors.mooncake_master`)")
            with MooncakeMaster(segment_bytes=cfg.mooncake_segment) as master:
                manifest = run_extraction(cfg, master.endpoint)
    else:
        manifest = run_extraction(cfg)
    print(f"[extract] done: {len(manifest['sample_ids'])} samples, {manifest['num_tokens']} tokens "
          f"({cfg.store} store)")
    return manifest


if __name__ == "__main__":
    run_job_main(main)
