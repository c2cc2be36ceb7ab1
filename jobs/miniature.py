"""The miniature run: the whole DSpark life cycle on this machine with a local Ray cluster and the real SmolLM2
target, on the project's small shipped prompt set (36 math / code / chat prompts):

    generate (Ray Data + vLLM) -> extract hidden states (vLLM, into Mooncake by default) -> train dspark (Ray Train,
    reading from Mooncake) -> calibrate (STS on held-out rollouts) -> evaluate (tau, speed vs no speculation)

Every stage is the same code as its job (jobs.generate, jobs.extract, jobs.train, jobs.calibrate, jobs.evaluate).
A stage whose output is complete is skipped on a rerun unless --force.  With --store mooncake the job starts a
mooncake_master on 127.0.0.1 for the extract + train stages and stops it afterwards; --store disk keeps the hidden
states on disk instead.  Ends with a summary table."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.runtime import apply_env, run_job_main


@dataclass
class MiniatureConfig:
    work: Path = field(default=Path("work/miniature"), metadata={"help": "folder for all artifacts of the run"})
    prompts: list[Path] = field(default_factory=list, metadata={
        "help": "prompt JSONL files (default: the project's shipped set of 36 math/code/chat prompts)"})
    target: str | None = field(default=None, metadata={"help": "target HF folder (default: prepared SmolLM2-135M)"})
    max_new_tokens: int = field(default=192, metadata={"help": "response length for generated training data"})
    store: str = field(default="mooncake", metadata={"help": "hidden-state backend between extract and train",
                                                     "choices": ["mooncake", "disk"]})
    train_steps: int = field(default=40, metadata={"help": "drafter training steps (4 sequences x 32 anchors each)"})
    eval_prompts: int = field(default=4, metadata={"help": "prompts evaluated (baseline vs dspark)"})
    eval_tokens: int = field(default=64, metadata={"help": "tokens generated per evaluated prompt"})
    serve_port: int = field(default=8000, metadata={"help": "HTTP port of the Serve app (127.0.0.1)"})
    inference_actors: int = field(default=1, metadata={
        "help": "vLLM actors for generate and extract (on a cluster with inference nodes: one per node)"})
    train_workers: int = field(default=1, metadata={"help": "Ray Train workers"})
    stages: str = field(default="all", metadata={
        "help": "comma-separated subset of generate,extract,train,calibrate,evaluate,serve (with --store mooncake, "
                "extract and train run together) or 'all'"})
    force: bool = field(default=False, metadata={"help": "rerun stages even if their output is complete"})
    address: str | None = field(default=None, metadata={"help": "Ray address (default: a local ray.init())"})


def main(argv=None):
    apply_env()
    from actors.extraction import ExtractConfig, run_extraction
    from actors.generation import GenerateConfig, run_generation
    from pipeline.core.config_cli import parse_config
    from pipeline.data.prompts import DEFAULT_PROMPTS
    from pipeline.core.runtime import init_ray
    from pipeline.data.shards import ShardSet

    cfg = parse_config(MiniatureConfig, argv, description=__doc__)
    known = ["generate", "extract", "train", "calibrate", "evaluate", "serve"]
    wanted = set(known) if cfg.stages == "all" else {s.strip() for s in cfg.stages.split(",") if s.strip()}
    if wanted - set(known):
        raise ValueError(f"--stages: unknown stage(s) {sorted(wanted - set(known))}; choose from {known}")
    w = cfg.work.resolve()
    w.mkdir(parents=True, exist_ok=True)
    init_ray(cfg.address)
    summary: list[tuple[str, str, float]] = []
    t_all = time.time()

    def stage(name, complete, fn):
        t = time.time()
        if not wanted & set(name.split(" ")[0].split("+")):
            summary.append((name, "not selected (--stages)", 0.0))
            return
        if complete and not cfg.force:
            summary.append((name, "skipped (complete)", 0.0))
            print(f"\n=== {name}: complete, skipped (use --force to redo)", flush=True)
            return
        print(f"\n=== {name}", flush=True)
        fn()
        summary.append((name, "done", time.time() - t))

    resp, hidden, train_dir = w / "responses", w / "hidden", w / "train_dspark"
    drafter = train_dir / "drafter"
    gen = GenerateConfig(prompts=cfg.prompts, out=resp, target=cfg.target, max_new_tokens=cfg.max_new_tokens,
                         pool_size=cfg.inference_actors, address=cfg.address)
    stage("generate", ShardSet(resp, "request_id").has_manifest(), lambda: run_generation(gen))

    train_cfg = dict(out=train_dir, max_steps=cfg.train_steps, seqs_per_step=4, num_anchors=32, holdout_frac=0.15,
                     checkpoint_every=20, log_every=5, workers=cfg.train_workers, target=cfg.target)
    ext = ExtractConfig(responses=resp, out=hidden, target=cfg.target, address=cfg.address, store=cfg.store,
                        pool_size=cfg.inference_actors)

    def train(**where):
        from jobs import train as train_job
        from pipeline.train.config import TrainConfig

        train_job.run(TrainConfig(**train_cfg, **where))

    if cfg.store == "mooncake":
        # hidden states live in Mooncake only while this job runs: extract + train together, skipped together
        def extract_and_train():
            from actors.mooncake_master import MooncakeMaster

            with MooncakeMaster(segment_bytes="3G") as master:
                ep = master.endpoint
                print(f"[miniature] mooncake master at {ep.master_addr} (metadata {ep.metadata_url})")
                m = run_extraction(ext, ep)
                print(f"[miniature] extracted {len(m['sample_ids'])} samples into Mooncake")
                train(store="mooncake", mooncake_master=ep.master_addr, mooncake_metadata=ep.metadata_url,
                      mooncake_prefix=ext.mooncake_prefix)

        stage("extract+train (mooncake)", (drafter / "config.json").is_file(), extract_and_train)
    else:
        stage("extract (disk)", (hidden / "manifest.json").is_file(), lambda: run_extraction(ext))
        stage("train", (drafter / "config.json").is_file(), lambda: train(data=hidden))

    calib = drafter / "calibration" / "calibration.json"

    def calibrate():
        from jobs import calibrate as calibrate_job
        from pipeline.eval.sts_rollouts import CalibrateConfig

        calibrate_job.run(CalibrateConfig(drafter=drafter, responses=resp, limit=6, max_new_tokens=64,
                                          target=cfg.target))

    stage("calibrate", calib.is_file(), calibrate)

    ev = w / "eval"

    def evaluate():
        from jobs import evaluate as evaluate_job
        from pipeline.eval.evaluation import EvalConfig

        evaluate_job.run(EvalConfig(drafter=[f"dspark={drafter}"],
                                    benchmarks=[Path(cfg.prompts[0]) if cfg.prompts else DEFAULT_PROMPTS],
                                    limit=cfg.eval_prompts, max_new_tokens=cfg.eval_tokens, out=ev,
                                    vllm_baselines=["none"], target=cfg.target))

    stage("evaluate", (ev / "results.json").is_file(), evaluate)
    def serve_one_request():
        """Deploy the Serve app with the trained drafter, ask one chat question through the openai client, shut down."""
        from openai import OpenAI
        from ray import serve

        from jobs.serve import run
        from serve_app.app import ServeConfig

        scfg = ServeConfig(drafter=str(drafter), target=cfg.target, replicas=1, port=cfg.serve_port,
                           scheduler="hardware", address=cfg.address)
        url = run(scfg, block=False)
        try:
            client = OpenAI(base_url=url, api_key="unused", timeout=600)
            r = client.chat.completions.create(model=scfg.served_model_name(), max_tokens=48, temperature=0,
                                               messages=[{"role": "user", "content": "What is 12 + 30?"}])
            print(f"[miniature] chat answer via {url}: {r.choices[0].message.content!r}")
        finally:
            serve.shutdown()

    stage("serve (1 chat request)", False, serve_one_request)

    print("\n=== summary")
    print(f"{'stage':<26} {'status':<36} {'seconds':>8}")
    for name, status, sec in summary:
        print(f"{name:<26} {status:<36} {sec:8.1f}")
    if (ev / "results.json").is_file():
        res = json.loads((ev / "results.json").read_text())
        o = res["overall"]
        d = o.get("dspark", {})
        print(f"\ntau (dspark, greedy, {d.get('prompts')} prompts): {d.get('tau', float('nan')):.2f}   "
              f"speedup vs fastest no-speculation ({res['fastest_baseline']}): "
              f"{d.get('speedup_vs_fastest_baseline', float('nan')):.2f}x   "
              f"greedy mismatches: {d.get('greedy_mismatches_vs_baseline')}")
    if calib.is_file():
        c = json.loads(calib.read_text())
        print("STS ECE per position before -> after: " + ", ".join(
            f"{b:.3f}->{a:.3f}" for b, a in zip(c["before"]["ece"], c["after"]["ece"])))
    print(f"\nartifacts: responses {resp}, drafter {drafter}, eval {ev}   (total {time.time() - t_all:.0f}s)")
    return summary


if __name__ == "__main__":
    run_job_main(main)
