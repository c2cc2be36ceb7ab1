"""Serve the target with a DSpark speculator over an OpenAI-compatible HTTP API (Ray Serve).

Locally (starts Ray on loopback, deploys, blocks until Ctrl-C, then shuts Serve down):
    python -m jobs.serve --drafter work/drafter --replicas 2 --port 8000 --scheduler hardware
On a cluster (deploys and returns; the Serve application keeps running):
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m jobs.serve --drafter /path/to/drafter --replicas 2
On GPUs with vLLM (speculative_config method=dspark; --tensor-parallel-size GPUs per replica; the same load-aware
router places requests; docs/serving_on_gpu.md):
    python -m jobs.serve --engine vllm --drafter /path/to/drafter --replicas 2 --gpu-memory-utilization 0.9
Without --drafter (or with --scheduler none) the replicas decode without speculation.  --dry-run prints the Serve
deployments, their Ray resources and the engine configuration as JSON and starts nothing.

Then:  curl http://127.0.0.1:8000/v1/models
       curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
            -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
       curl http://127.0.0.1:8000/metrics
or the `openai` client with base_url="http://127.0.0.1:8000/v1".  Every option can also come from --config FILE.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from pipeline.core.config_cli import parse_config
from pipeline.launch.launch_plan import print_plan
from pipeline.core.runtime import apply_env, init_ray, run_job_main
from serve_app.app import ServeConfig, deploy, serve_plan
from serve_app.readiness import NotReady


def main(argv=None):
    apply_env()
    cfg = parse_config(ServeConfig, argv, description=__doc__)
    if cfg.dry_run:
        return print_plan(serve_plan(cfg))
    return run(cfg)


def run(cfg, block: bool | None = None):
    init_ray(cfg.address)
    from ray import serve

    in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    block = cfg.block if block is None else block
    if block is None:
        block = not in_job
    try:
        url = deploy(cfg, report=lambda msg: print(msg, flush=True))
    except NotReady as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if block:  # the local run owns Serve: leave nothing behind
            serve.shutdown()
        raise SystemExit(3) from None
    print(f"serving {cfg.served_model_name()} at {url}  (engine={cfg.engine}, replicas={cfg.replicas}, "
          f"scheduler={cfg.scheduler}, drafter={cfg.drafter})", flush=True)
    if not block:
        return url

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)  # also when started with SIGINT ignored (background shells)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down", flush=True)
        serve.shutdown()
    return url


if __name__ == "__main__":
    run_job_main(main)
