"""Stage 3 - train the DSpark (or DFlash baseline) drafter with Ray Train on the stage-2 hidden states.

TorchTrainer runs pipeline.training.train_loop_per_worker on --workers CPU workers (gloo all-reduce of the
gradients), reading samples from the disk store or Mooncake through the same interface.  Writes to --out:
metrics.jsonl, loss_curve.png, learning_curve.png (held-out tau vs supervised positions seen,
every --eval-every steps), Ray Train checkpoints (every --checkpoint-every steps and at the end; --resume
continues from the latest with identical optimizer/scheduler state), plan.json (draft vocabulary, split) and the
exported drafter checkpoint `drafter/` (speculators / vLLM `method: dspark` format)."""
from __future__ import annotations

from pipeline.runtime import apply_env, reexec_for_process_env


def main(argv=None):
    apply_env()
    from ray.train import CheckpointConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.config_cli import parse_config
    from pipeline.runtime import init_ray
    from pipeline.shards import atomic_write_json
    from pipeline.train_backend import LoopbackTorchConfig
    from pipeline.placement import TRAINING, role_resources
    from pipeline.training import (TrainConfig, latest_checkpoint, plan, plot_learning_curves, plot_metrics,
                                   train_loop_per_worker)

    cfg = parse_config(TrainConfig, argv, description=__doc__)
    cfg.out, cfg.data = cfg.out.resolve(), cfg.data.resolve()
    cfg.out.mkdir(parents=True, exist_ok=True)
    resume_from = None
    if cfg.resume:
        resume_from = latest_checkpoint(cfg.out)
        if resume_from is None:
            raise SystemExit(f"--resume: no checkpoint under {cfg.out}/ray")
        print(f"[train] resuming from {resume_from}")
    else:  # a fresh run: fresh log, and no Ray Train run state to auto-restore from
        import shutil

        (cfg.out / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(cfg.out / "ray", ignore_errors=True)
    # Ray Train v2's placement-group cleaner polls the state API every second, which needs the dashboard: without
    # it every poll fails with a warning. A local cluster started here gets one (bound to 127.0.0.1).
    ray = init_ray(cfg.address, dashboard=True)
    p = plan(cfg)
    print(f"[train] {len(p['train_ids'])} training / {len(p['holdout_ids'])} held-out samples, "
          f"{p['total_steps']} steps; {p['draft_vocab_report']}")
    atomic_write_json(cfg.out / "plan.json", {k: v for k, v in p.items() if k != "train"} | {"config": p["train"]})
    resources = role_resources(TRAINING, cfg.worker_resources, "worker-resources")
    print(f"[train] {cfg.workers} worker(s), resources {resources or 'unconstrained'}")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=p | {"resume_from": str(resume_from) if resume_from else None},
        torch_config=LoopbackTorchConfig(),  # store + gloo on 127.0.0.1
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=False,
                                     resources_per_worker={"CPU": cfg.cpus_per_worker, **resources}),
        run_config=RunConfig(name="train", storage_path=str(cfg.out / "ray"),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             # Train's print patch sends a worker's print to its logger AND (as our workers' stdout
                             # is wrapped) to stdout: every line twice on the driver. Plain prints, once.
                             worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
                             # its per-report INFO lines ("Reporting training result ...") repeat our step lines
                             logging_config=LoggingConfig(log_level="WARNING")),
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    plot_metrics(cfg.out / "metrics.jsonl", cfg.out / "loss_curve.png")
    curve = cfg.out / "learning_curve.png"
    has_curve = plot_learning_curves({cfg.drafter: cfg.out / "metrics.jsonl"}, curve)
    print(f"[train] done: drafter at {cfg.out / 'drafter'}, metrics {cfg.out / 'metrics.jsonl'}, "
          f"curves {cfg.out / 'loss_curve.png'}" + (f", {curve}" if has_curve else ""))
    return result


if __name__ == "__main__":
    reexec_for_process_env()  # start-only settings (malloc tunables) for this process too
    main()
