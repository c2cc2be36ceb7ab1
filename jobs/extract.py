"""Stage 2 - extract the target's hidden states for every response (Ray Data + vLLM extractor actors).

For each stage-1 row (prompt + response) stores: token ids, loss mask, the chosen target layers concatenated (bf16)
and the final hidden state before the LM head (bf16), in Parquet shards on disk (--store disk) or in a Mooncake
store (--store mooncake; the job starts a mooncake_master on 127.0.0.1 and stops it unless --mooncake-master names
a running one).  Resumable: stored samples are skipped; the manifest is written last."""
from __future__ import annotations

from pipeline.runtime import apply_env, reexec_for_process_env


def main(argv=None):
    apply_env()
    from actors.extraction import ExtractConfig, run_extraction
    from pipeline.config_cli import parse_config

    cfg = parse_config(ExtractConfig, argv, description=__doc__)
    if cfg.store == "mooncake":
        from actors.mooncake_master import MooncakeMaster

        if cfg.mooncake_master:
            if not cfg.mooncake_metadata:
                raise SystemExit("--mooncake-master needs --mooncake-metadata (the master's metadata server URL)")
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
    reexec_for_process_env()  # start-only settings (malloc tunables) for this process too
    main()
