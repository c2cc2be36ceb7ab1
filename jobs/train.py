"""Stage 3 - train the DSpark (or DFlash baseline) drafter on the stage-2 hidden states.

One training loop (pipeline.train.trainer.Trainer), two back ends:

* --backend ray (default): Ray Train's TorchTrainer runs it on --workers workers - CPU workers with a gloo
  all-reduce of the gradients, or with --gpus-per-worker G GPU workers (NCCL, bf16 autocast, each on its own
  device); the workers' extra resources follow the node roles of pipeline/launch/placement.py (--worker-resources);
  --fsdp shards the drafter's parameters, gradients and optimizer state over the workers instead of replicating
  them (FSDP2, pipeline/train/fsdp.py: for drafters too large for one device; the same checkpoints);
* --backend local: the same loop in this process, without Ray (one GPU or a laptop; --device); with --prompts it
  first generates the responses and extracts their hidden states in this process too (transformers).

Samples come from the disk store or Mooncake through the same interface.  Writes to --out: metrics.jsonl,
loss_curve.png, learning_curve.png (held-out tau vs supervised positions seen, every --eval-every steps),
checkpoints (every --checkpoint-every steps and at the end: Ray Train's under ray/, the local back end's under
checkpoints/, the same train_state.pt; --resume continues from the latest with identical optimizer/scheduler state),
plan.json (draft vocabulary, split) and the exported drafter checkpoint `drafter/` (speculators / vLLM
`method: dspark` format).  --dry-run prints, as JSON, what would be launched and exits.

After training: jobs.calibrate and jobs.evaluate (both run in one process, --device)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from pipeline.core.config_cli import parse_config
from pipeline.train.fsdp import UNITS_SUMMARY
from pipeline.launch.launch_plan import print_plan
from pipeline.train.local_stages import run_local_stages
from pipeline.launch.placement import TRAINING, parse_resources, planned_role_resources, role_resources
from pipeline.core.runtime import apply_env, init_ray, resolve_device, run_job_main
from pipeline.data.shards import atomic_write_json
from pipeline.stores import open_hidden_store
from pipeline.train.trainer import train_local
from pipeline.train.config import LOCAL_CHECKPOINTS, TrainConfig, use_bf16_autocast
from pipeline.train.metrics import latest_checkpoint, plot_learning_curves, plot_metrics
from pipeline.train.dataset import plan, planned_steps, training_split

RUN_NAME = "train"  # Ray Train's run folder under <out>/ray
CHECKPOINTS_KEPT = 2


def main(argv=None):
    apply_env()
    return run(parse_config(TrainConfig, argv, description=__doc__))


def run(cfg: TrainConfig):
    """Train (or, with --dry-run, print the plan of) the run ``cfg`` describes; what jobs.recipe and jobs.miniature
    call for their training stage."""
    cfg.out, cfg.data = cfg.out.resolve(), cfg.data.resolve()
    if cfg.dry_run:
        return print_plan(dry_run(cfg))
    cfg.out.mkdir(parents=True, exist_ok=True)
    resume_from = resume_point(cfg)
    if cfg.backend == "local":
        if cfg.prompts:  # stages 1-2 first, in this process
            run_local_stages(cfg, torch.device(resolve_device(cfg.device)))
        result = train_local(write_plan(cfg), resume_from)
    else:
        result = fit_on_ray(cfg, resume_from)
    plot_metrics(cfg.out / "metrics.jsonl", cfg.out / "loss_curve.png")
    curve = cfg.out / "learning_curve.png"
    has_curve = plot_learning_curves({cfg.drafter: cfg.out / "metrics.jsonl"}, curve)
    print(f"[train] done: drafter at {cfg.out / 'drafter'}, metrics {cfg.out / 'metrics.jsonl'}, "
          f"curves {cfg.out / 'loss_curve.png'}" + (f", {curve}" if has_curve else ""))
    return result


def resume_point(cfg: TrainConfig):
    """--resume: the latest checkpoint under --out (either back end's); where there is none yet (the run was
    stopped before its first checkpoint, or never started) the run starts at step 0, so the same command both
    starts a run and finishes it however it was stopped.  A fresh run: a fresh log, and no old checkpoints (Ray
    Train would auto-restore from its run state)."""
    if cfg.resume:
        resume_from = latest_checkpoint(cfg.out)
        if resume_from is not None:
            print(f"[train] resuming from {resume_from}")
            return resume_from
        print(f"[train] --resume: no checkpoint under {cfg.out}/ray or {cfg.out}/{LOCAL_CHECKPOINTS} yet; "
              "starting at step 0")
    (cfg.out / "metrics.jsonl").unlink(missing_ok=True)
    for sub in ("ray", LOCAL_CHECKPOINTS):
        shutil.rmtree(cfg.out / sub, ignore_errors=True)
    return None


def write_plan(cfg: TrainConfig) -> dict:
    """pipeline.train.dataset.plan (ids, split, draft vocabulary, steps), printed and kept as plan.json."""
    p = plan(cfg)
    print(f"[train] {len(p['train_ids'])} training / {len(p['holdout_ids'])} held-out samples, "
          f"{p['total_steps']} steps; {p['draft_vocab_report']}")
    atomic_write_json(cfg.out / "plan.json", {k: v for k, v in p.items() if k != "train"} | {"config": p["train"]})
    return p


# ---- Ray Train ---------------------------------------------------------------------------------------------------
def scaling_fields(cfg: TrainConfig, role: dict) -> dict:
    """ScalingConfig's arguments: --workers workers, each --cpus-per-worker CPUs (+ --gpus-per-worker GPUs) and the
    training role's resources `role`."""
    gpu = {"GPU": float(cfg.gpus_per_worker)} if cfg.gpus_per_worker > 0 else {}
    return dict(num_workers=cfg.workers, use_gpu=cfg.gpus_per_worker > 0,
                resources_per_worker={"CPU": float(cfg.cpus_per_worker), **gpu, **role})


def run_fields(cfg: TrainConfig) -> dict:
    return dict(name=RUN_NAME, storage_path=str(cfg.out / "ray"), checkpoints_kept=CHECKPOINTS_KEPT)


def fit_on_ray(cfg: TrainConfig, resume_from):
    from ray.train import CheckpointConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.train.ray_train import LoopbackTorchConfig, train_loop_per_worker

    # Ray Train v2's placement-group cleaner polls the state API every second, which needs the dashboard: without
    # it every poll fails with a warning. A local cluster started here gets one (bound to 127.0.0.1).
    init_ray(cfg.address, dashboard=True)
    p = write_plan(cfg)
    scaling = scaling_fields(cfg, role_resources(TRAINING, cfg.worker_resources, "worker-resources"))
    print(f"[train] {cfg.workers} worker(s), resources {scaling['resources_per_worker']}, "
          f"{cfg.process_group_backend}, {data_parallel_plan(cfg)['strategy']}")
    run = run_fields(cfg)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=p | {"resume_from": str(resume_from) if resume_from else None},
        torch_config=LoopbackTorchConfig(backend=cfg.process_group_backend),  # store + sockets on 127.0.0.1
        scaling_config=ScalingConfig(**scaling),
        run_config=RunConfig(name=run["name"], storage_path=run["storage_path"],
                             checkpoint_config=CheckpointConfig(num_to_keep=run["checkpoints_kept"]),
                             # Train's print patch sends a worker's print to its logger AND (as our workers' stdout
                             # is wrapped) to stdout: every line twice on the driver. Plain prints, once.
                             worker_runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
                             # its per-report INFO lines ("Reporting training result ...") repeat our step lines
                             logging_config=LoggingConfig(log_level="WARNING")),
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    drop_unregistered_checkpoints(cfg.out / "ray" / RUN_NAME, result)
    return result


def drop_unregistered_checkpoints(run_dir, result) -> list:
    """After a finished run: remove the checkpoint folders under Ray Train's run folder that it does not hold.  Ray
    Train keeps the checkpoints it registered (the newest CHECKPOINTS_KEPT) and deletes the older ones; a checkpoint
    that a killed run's worker had persisted but its controller not yet registered (it takes reports at its 2 s
    health check) is in no record, and would stay for good.  Returns the folders removed."""
    held = {Path(c.path).resolve() for c, _ in (result.best_checkpoints or [])}
    if result.checkpoint is not None:
        held.add(Path(result.checkpoint.path).resolve())
    if not held:  # no record to go by: keep everything
        return []
    dropped = [d for d in Path(run_dir).glob("checkpoint_*") if d.is_dir() and d.resolve() not in held]
    for d in dropped:
        shutil.rmtree(d, ignore_errors=True)
    if dropped:
        print(f"[train] removed {len(dropped)} checkpoint folder(s) an interrupted run left: "
              + ", ".join(d.name for d in dropped))
    return dropped


# ---- --dry-run ---------------------------------------------------------------------------------------------------
def dry_run(cfg: TrainConfig) -> dict:
    """What `main` would launch, without starting Ray or training: the Ray resources (ScalingConfig fields, the
    placement rule of the training role, the cluster total), the torch back end and dtype, the trainer
    configuration, and the data it would read (the store's manifest only: sample counts and the step count).
    With the auto placement rule, resources_per_worker is what a cluster that declares training nodes is asked
    for; on one that does not, the training role's part is dropped (placement.otherwise)."""
    out = dict(job="train", backend=cfg.backend)
    if cfg.backend == "ray":
        # pipeline/launch/placement.py's rule; "auto" is decided by the cluster at launch
        placement = dict(role=TRAINING) | planned_role_resources(
            TRAINING, parse_resources(cfg.worker_resources, "worker-resources"))
        scaling = scaling_fields(cfg, placement["resources"])
        per_worker = scaling["resources_per_worker"]
        total = dict(num_cpus=per_worker["CPU"] * cfg.workers, num_gpus=per_worker.get("GPU", 0.0) * cfg.workers,
                     resources={k: v * cfg.workers for k, v in per_worker.items() if k not in ("CPU", "GPU")})
        out["ray"] = dict(address=cfg.address or os.environ.get("RAY_ADDRESS") or "local (ray.init on 127.0.0.1)",
                          scaling_config=scaling, placement=placement, total=total,
                          torch_config=dict(cls="pipeline.train.ray_train.LoopbackTorchConfig",
                                            backend=cfg.process_group_backend,
                                            rendezvous="TCPStore + gloo/NCCL sockets on 127.0.0.1 when the node "
                                                       "address is 127.0.0.1, else Ray Train's default"),
                          run_config=run_fields(cfg))
        device = "cuda (ray.train.torch.get_device(), one per worker)" if cfg.gpus_per_worker > 0 else "cpu"
        device_type = "cuda" if cfg.gpus_per_worker > 0 else "cpu"
        process_group = cfg.process_group_backend
    else:
        out["ray"] = None
        device = resolve_device(cfg.device)  # auto: what PyTorch sees here
        device_type = device.split(":")[0]
        process_group = None
    bf16 = use_bf16_autocast(cfg, device_type)
    out["torch"] = dict(device=device, process_group=process_group, master_weights="float32",
                        autocast="bfloat16" if bf16 else None, threads_per_worker=cfg.cpus_per_worker)
    out["data_parallel"] = data_parallel_plan(cfg) if cfg.backend == "ray" else None
    out["trainer"] = cfg.to_plan()
    out["data"] = data_summary(cfg)
    out["stages"] = None if not cfg.prompts or out["data"]["manifest"] != "absent" else dict(
        prompts=[str(p) for p in cfg.prompts], responses=str(cfg.out / "responses"), hidden_states=str(cfg.data),
        generator="transformers generate, greedy", extractor="hf", target_dtype=cfg.target_dtype)
    return out


def data_parallel_plan(cfg: TrainConfig) -> dict:
    """How the Ray Train workers share the drafter: replicated with one gradient all-reduce per step ("ddp"), or
    sharded (--fsdp, "fsdp")."""
    if cfg.fsdp:
        return dict(strategy="fsdp", sharded="parameters, gradients, optimizer state (FSDP2 fully_shard)",
                    units=UNITS_SUMMARY, gradients="reduce-scatter, summed over workers",
                    checkpoint="full state dicts gathered to rank 0 (the same format as ddp)")
    return dict(strategy="ddp", sharded=None, units=None,
                gradients="one flat all-reduce per step, summed over workers",
                checkpoint="rank 0's state dicts (parameters broadcast from rank 0 at start)")


def data_summary(cfg: TrainConfig) -> dict:
    """The store's manifest -> samples, split and step count (no sample is read); a missing store is said, not
    fatal (a dry run may precede extraction)."""
    where = str(cfg.data) if cfg.store == "disk" else f"mooncake:{cfg.mooncake_prefix}"
    if cfg.store == "disk" and not (cfg.data / "manifest.json").is_file():
        return dict(store=cfg.store, location=where, manifest="absent", total_steps=cfg.max_steps)
    store = open_hidden_store(cfg.store, cfg.data, cfg.mooncake_prefix, master_addr=cfg.mooncake_master,
                              metadata_url=cfg.mooncake_metadata)
    try:
        manifest = store.manifest()
    finally:
        store.close()
    ids = list(manifest["sample_ids"])
    train_ids, hold_ids = training_split(ids, cfg)
    return dict(store=cfg.store, location=where, manifest="found", samples=len(ids), train_samples=len(train_ids),
                holdout_samples=len(hold_ids), layer_ids=manifest.get("layer_ids"),
                num_tokens=manifest.get("num_tokens"), seqs_per_step_all_workers=cfg.seqs_per_step * cfg.workers,
                total_steps=planned_steps(cfg, len(train_ids)),
                resume_from=str(latest_checkpoint(cfg.out)) if cfg.resume else None)


if __name__ == "__main__":
    run_job_main(main)
