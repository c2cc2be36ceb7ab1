"""Serve the target with a DSpark speculator over an OpenAI-compatible HTTP API (Ray Serve).

Locally (starts Ray on loopback, deploys, blocks until Ctrl-C, then shuts Serve down):
    python -m jobs.serve --drafter work/drafter --replicas 2 --port 8000 --scheduler hardware
On a cluster (deploys and returns; the Serve application keeps running):
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m jobs.serve --drafter /path/to/drafter --replicas 2
Without --drafter (or with --scheduler none) the replicas decode without speculation.

Then:  curl http://127.0.0.1:8000/v1/models
       curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
            -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
       curl http://127.0.0.1:8000/metrics
or the `openai` client with base_url="http://127.0.0.1:8000/v1".  Every option can also come from --config FILE.
"""
from __future__ import annotations

import os
import signal
import time

from pipeline.runtime import apply_env, reexec_for_process_env


def main(argv=None):
    apply_env()
    from pipeline.config_cli import parse_config
    from serve_app.app import ServeConfig

    cfg = parse_config(ServeConfig, argv, description=__doc__)
    return run(cfg)


def run(cfg, block: bool | None = None):
    from pipeline.runtime import init_ray
    from serve_app.app import build_app

    init_ray(cfg.address)
    from ray import serve

    app = build_app(cfg)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
    url = f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1"
    print(f"serving {cfg.served_model_name()} at {url}  (replicas={cfg.replicas}, scheduler={cfg.scheduler}, "
          f"drafter={cfg.drafter})", flush=True)
    in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    block = cfg.block if block is None else block
    if block is None:
        block = not in_job
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
    reexec_for_process_env()  # start-only settings (malloc tunables) for this process too
    main()
