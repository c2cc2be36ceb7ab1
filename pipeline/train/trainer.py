"""ONE training loop for the drafter, whichever way it is launched: ``Trainer(plan, placement, hooks).fit()``.

* ``plan``: pipeline.train.dataset.plan()'s dict (config, sample ids, split, draft vocabulary, step count);
* ``placement``: where this worker sits (rank, world size, torch device);
* ``hooks``: what the launcher plugs in - the state to resume from, and where reports and checkpoints go.

Two launchers build it: Ray Train's worker loop (pipeline.train.ray_train.train_loop_per_worker: rank and world from
the Train context, device from ray.train.torch.get_device(), checkpoints through ray.train.report) and one plain
process (``train_local``, jobs.train --backend local: rank 0 of 1, checkpoints in <out>/checkpoints).  Both write
the same STATE_FILE, so either resumes either's checkpoint.

fit() reads top to bottom: for each step: this rank's sequences (prefetched) -> anchors -> the loss of every
sequence against ONE global weight sum (Σw over all sequences of the step on all ranks, docs/dspark.md §5) ->
backward -> all-reduce of the gradients (DDP-equivalent: one flat all-reduce per step) -> clip -> AdamW and
warmup/cosine step -> log (rank 0; held-out tau every --eval-every steps) -> checkpoint; at the end rank 0 exports
the drafter.  With --fsdp the drafter is sharded over the workers instead (pipeline/train/fsdp.py): FSDP2
gathers each unit's parameters for its forward/backward and reduce-scatters (sums) the gradients, so there is no
separate all-reduce; every rank runs the held-out evaluation, the checkpoint's state gathering and the export's
(collectives), rank 0 writes them, in the replicated run's format.  Resuming restores model + optimizer +
scheduler + step + positions seen; the data order comes from (seed, epoch) and each step's random draws from
(seed, rank, step), so the resumed losses equal the uninterrupted.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.dspark.checkpoint import export_checkpoint
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.losses import LossConfig, TargetHead
from pipeline.core.file_lock import sweep_temporaries, temporary_name
from pipeline.train.fsdp import (full_model_state, full_norm, full_state, load_full_state, parameter_elements,
                                 shard_drafter)
from pipeline.core.runtime import resolve_device
from pipeline.dspark.target_weights import load_target_layers, load_target_weights
from pipeline.train.config import (LOCAL_CHECKPOINTS, STATE_FILE, TrainConfig, build_drafter_config, lr_lambda,
                                   use_bf16_autocast)
from pipeline.train.step import accumulate_gradients, micro_batch_count, step_blocks, step_seed
from pipeline.train.metrics import append_metrics, metrics_row
from pipeline.train.dataset import eval_store_samples, heldout_eval_ids, open_store, step_sample_ids
from pipeline.train.heldout import greedy_walk_tau, teacher_forced_tau


@dataclass(frozen=True)
class Placement:
    """Where one trainer runs: its rank among `world` data-parallel workers and its torch device."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


class TrainerHooks:
    """The launcher's side of a run.  This base starts fresh and keeps no checkpoints (metrics.jsonl and the exported
    drafter are written by the Trainer itself)."""

    def load_state(self, map_location) -> dict | None:
        """The checkpoint state (STATE_FILE's content) to continue from, or None for a fresh start."""
        return None

    def report(self, row: dict, checkpoint: Path | None) -> None:
        """Called by EVERY rank at every logged step with that step's metrics row; `checkpoint` is the folder rank 0
        just wrote (holding STATE_FILE, deleted after the call) on a checkpoint step, else None."""


# <temp>/train-checkpoint.tmp-<pid>-<random>: a checkpoint rank 0 writes and hands to the launcher (pipeline.core.file_lock
# names: a folder left by a writer that was killed while reporting is swept when the next Trainer starts)
CHECKPOINT_STAGING = "train-checkpoint"


@contextmanager
def checkpoint_staging():
    """A fresh folder for one checkpoint on its way to the launcher (which copies it), removed afterwards."""
    folder = temporary_name(Path(tempfile.gettempdir()) / CHECKPOINT_STAGING)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class StepResult:
    """One optimizer step, summed over all ranks where it says so."""

    parts: dict  # loss parts of this rank's sequences (each already divided by the GLOBAL weight sum)
    supervised: int  # supervised positions of the step, all ranks
    acc: torch.Tensor  # [γ] per-position top-1 accuracy · count, this rank
    grad_norm: float


class Trainer:
    """Model, optimizer, scheduler, data order, anchors, step counter, evaluation and checkpoint state of one worker
    (module docstring)."""

    def __init__(self, plan: dict, placement: Placement = Placement(), hooks: TrainerHooks = TrainerHooks()):
        self.plan, self.placement, self.hooks = plan, placement, hooks
        self.cfg = cfg = TrainConfig.from_plan(plan["train"])
        self.rank, self.world, self.device = placement.rank, placement.world, torch.device(placement.device)
        self.target = Path(plan["target"])
        self.train_ids: list[str] = plan["train_ids"]
        self.total_steps: int = plan["total_steps"]
        self.metrics_path = Path(cfg.out) / "metrics.jsonl"
        sweep_temporaries(tempfile.gettempdir(), CHECKPOINT_STAGING)  # what killed writers left (checkpoint_staging)
        torch.set_num_threads(cfg.cpus_per_worker)
        torch.manual_seed(cfg.seed)

        # the drafter: fp32 master weights on this worker's device, identical on every rank
        self.draft_ids = torch.tensor(plan["draft_ids"], dtype=torch.long) if plan["draft_ids"] is not None else None
        self.drafter_config = build_drafter_config(cfg, self.target, plan["layer_ids"],
                                                   len(plan["draft_ids"] or []) or None)
        self.model = DSparkDrafter.from_target(self.drafter_config, self.target, draft_ids=self.draft_ids)
        if cfg.init_layers == "target":
            self.model.init_layers_from(load_target_layers(self.target, cfg.num_layers))
        self.model.to(self.device)
        if self.world > 1:
            for p in self.model.trainable_parameters():
                dist.broadcast(p.data, 0)
        self.fsdp = cfg.fsdp
        if self.fsdp:  # sharded from identical full weights
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("--fsdp shards the drafter over a torch.distributed process group, and this "
                                   "worker has none (use --backend ray)")
            shard_drafter(self.model, self.device)
            held, total = parameter_elements(self.model)
            self.say(f"FSDP: {total:,} parameter elements sharded over {self.world} worker(s), rank 0 holds {held:,}")
        self.params = self.model.trainable_parameters()
        self.bf16 = use_bf16_autocast(cfg, self.device)

        # the loss and, for the distribution / confidence terms, the target's LM head over the draft vocabulary
        self.loss_cfg = LossConfig(kind=cfg.drafter, distance=cfg.distance, decay=cfg.decay_value())
        self.target_head = None
        if self.loss_cfg.dist_weight > 0 or self.loss_cfg.conf_weight > 0:
            lm_head = load_target_weights(self.target).lm_head.to(self.device)
            self.target_head = TargetHead(lm_head, self.model.draft_ids)

        # AdamW (fused: each parameter's update in one pass instead of a chain of element-wise ops, much faster
        # than the for-each kernel on CPU) with linear warmup then cosine to 0
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_lambda(self.total_steps, cfg.warmup_frac))
        self.step = 0  # optimizer steps done
        self.stop_reason = ""  # why fit() ended early (should_stop)
        self.positions_seen = 0  # supervised positions trained on, all ranks, kept across resumes
        self.hold_ids = heldout_eval_ids(plan.get("holdout_ids") or [], cfg.eval_samples)
        self._hold_samples = None  # loaded on first evaluation (rank 0)
        # --eval-data's samples {source file: [sample]} on the ranks that evaluate, loaded now so that a wrong store
        # fails before training
        evaluates = self.rank == 0 or self.fsdp
        self._eval_samples = (eval_store_samples(cfg, plan["layer_ids"]) if cfg.eval_data is not None and evaluates
                              else None)
        state = hooks.load_state(self.device)
        if state is not None:
            self.load_state_dict(state)
            self.say(f"resumed at step {self.step}")

    # ---- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> bool:
        """Train from the current step to the plan's last one, or until --stop-after / --max-seconds end the run
        early (checkpointed).  True when the run is complete (rank 0 has exported the drafter)."""
        cfg, total = self.cfg, self.total_steps
        store = open_store(cfg)
        started, t_last, positions_since = time.time(), time.time(), 0
        try:
            with closing(self.batches(store)) as batches:
                for step, samples in batches:
                    result = self.train_step(step, samples)
                    positions_since += result.supervised
                    stopping = self.should_stop(started)
                    is_ckpt = self.step % cfg.checkpoint_every == 0 or self.step == total or stopping
                    is_eval = bool(cfg.eval_every) and (self.step % cfg.eval_every == 0 or self.step == total)
                    if self.step % cfg.log_every == 0 or is_ckpt or is_eval:
                        row = metrics_row(self.step, self.scheduler.get_last_lr()[0], result.grad_norm,
                                          positions_since, time.time() - t_last, result.supervised, result.parts,
                                          result.acc, self.positions_seen)
                        if is_eval and (self.rank == 0 or self.fsdp):  # sharded: every rank takes part
                            heldout = self.evaluate(store)
                            row |= heldout if self.rank == 0 else {}
                        t_last, positions_since = time.time(), 0
                        self.log(row, result.parts)
                        self.report(row, checkpoint=is_ckpt)
                    if stopping and self.step < total:
                        self.say(f"stopping after step {self.step} ({self.stop_reason}); rerun with --resume "
                                 "to finish")
                        break
            complete = self.step == total
            if complete and (self.rank == 0 or self.fsdp):
                self.export()
            return complete
        finally:
            store.close()

    def batches(self, store):
        """(step, this rank's samples) from the current step to the last; the next step's samples are read from the
        store while this one trains."""
        cfg, total = self.cfg, self.total_steps

        def fetch(step):
            ids = step_sample_ids(self.train_ids, step, cfg.seqs_per_step, self.world, self.rank, cfg.seed)
            return [store.get(i) for i in ids]

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(fetch, self.step) if self.step < total else None
            for step in range(self.step, total):
                samples = pending.result()
                pending = pool.submit(fetch, step + 1) if step + 1 < total else None
                yield step, samples

    def train_step(self, step: int, samples: list[dict]) -> StepResult:
        """One optimizer step on this rank's sequences (every rank calls it with the same `step`)."""
        cfg = self.cfg
        blocks, local_wsum = step_blocks(samples, cfg.num_anchors, cfg.block_size, self.loss_cfg.decay, cfg.seed,
                                         self.rank, step)
        denom = max(float(self.sum_over_ranks(torch.tensor([local_wsum]))), 1e-12)  # Σw of the step, fp32
        self.optimizer.zero_grad(set_to_none=True)
        parts, n_sup, acc = accumulate_gradients(
            self.model, self.target_head, samples, blocks, self.loss_cfg, denom, cfg.micro_batch, bf16=self.bf16,
            device=self.device, feature_noise=cfg.feature_noise,
            noise_seed=step_seed(cfg.seed, self.rank, step, "noise:"),
            min_chunks=self.max_chunks(blocks) if self.fsdp else 0)
        if self.world > 1:
            if not self.fsdp:  # FSDP reduce-scattered them already
                self.all_reduce_gradients()
            n_sup = int(self.sum_over_ranks(torch.tensor([n_sup])))
        grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.step = step + 1
        self.positions_seen += n_sup
        return StepResult(parts=parts, supervised=n_sup, acc=acc, grad_norm=grad_norm)

    def should_stop(self, started: float) -> bool:
        """--stop-after reached, or --max-seconds spent (any rank over it stops them all, at the same step)."""
        cfg = self.cfg
        if cfg.stop_after is not None and self.step >= cfg.stop_after:
            self.stop_reason = "--stop-after"
            return True
        if cfg.max_seconds is not None:
            over = torch.tensor([float(time.time() - started > cfg.max_seconds)])
            if float(self.sum_over_ranks(over)) > 0:
                self.stop_reason = f"--max-seconds {cfg.max_seconds:g}"
                return True
        return False

    # ---- collectives (no-ops for one worker) -----------------------------------------------------------------
    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a small tensor over all ranks (NCCL needs it on the device; the result comes back to the CPU)."""
        if self.world == 1:
            return t
        t = t.to(self.device)
        dist.all_reduce(t)
        return t.cpu()

    def max_chunks(self, blocks: list) -> int:
        """The most micro-batches any rank runs this step: with --fsdp every rank must run as many forward/backward
        passes (each gathers and reduce-scatters), so the others pad theirs (accumulate_gradients' min_chunks)."""
        mine = micro_batch_count(blocks, self.cfg.micro_batch)
        if self.world == 1:
            return mine
        t = torch.tensor([mine], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def all_reduce_gradients(self) -> None:
        """Sum the gradients over all ranks in ONE flat all-reduce (a parameter without a gradient counts as 0)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        off = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            if p.grad is None:
                p.grad = flat[off:off + n].view_as(p).clone()
            else:
                p.grad.copy_(flat[off:off + n].view_as(p))
            off += n

    # ---- evaluation, logging, checkpoints ----------------------------------------------------------------------
    def evaluate(self, store) -> dict:
        """Held-out greedy tau (teacher-forced, and replayed rounds with --eval-walk-tokens) as metrics fields; the
        same on --eval-data per source file."""
        out = {}
        if self.hold_ids:
            self._hold_samples = self._hold_samples or [store.get(i) for i in self.hold_ids]
            ev = teacher_forced_tau(self.model, self._hold_samples, self.cfg.eval_blocks)
            out |= dict(heldout_tau=ev["tau"], heldout_blocks=ev["blocks"], heldout_accept_hist=ev["accept_hist"])
            if self.cfg.eval_walk_tokens:
                walk = greedy_walk_tau(self.model, self._hold_samples, self.cfg.eval_walk_tokens)
                out |= dict(heldout_walk_tau=walk["tau"], heldout_walk_rounds=walk["rounds"])
        for tag, samples in (self._eval_samples or {}).items():  # the same measures on --eval-data, per file
            out[f"eval_tau_{tag}"] = teacher_forced_tau(self.model, samples, self.cfg.eval_blocks)["tau"]
            if self.cfg.eval_walk_tokens:
                out[f"eval_walk_tau_{tag}"] = greedy_walk_tau(self.model, samples, self.cfg.eval_walk_tokens)["tau"]
        return out

    def log(self, row: dict, parts: dict) -> None:
        """Rank 0: one metrics.jsonl row and one step line."""
        if self.rank != 0:
            return
        append_metrics(self.metrics_path, row)
        print(f"[train] step {row['step']}/{self.total_steps} loss {parts['loss']:.4f} "
              + " ".join(f"{k} {v:.4f}" for k, v in parts.items() if k != "loss")
              + f" | {row['positions_per_s']:.0f} pos/s lr {row['lr']:.2e}"
              + (f" | held-out tau {row['heldout_tau']:.3f}" if "heldout_tau" in row else "")
              + (f" (replayed {row['heldout_walk_tau']:.3f})" if "heldout_walk_tau" in row else "")
              + "".join(f" | {k[len('eval_walk_tau_'):]} replayed tau {v:.3f}" for k, v in row.items()
                        if k.startswith("eval_walk_tau_")), flush=True)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[train] {msg}", flush=True)

    def report(self, row: dict, checkpoint: bool) -> None:
        """Hand the row (and on checkpoint steps rank 0's freshly written checkpoint folder) to the launcher."""
        if not checkpoint:
            self.hooks.report(row, None)
            return
        with checkpoint_staging() as d:
            state = self.state_dict() if self.rank == 0 or self.fsdp else None  # sharded: gathered by all ranks
            if self.rank == 0:
                torch.save(state, d / STATE_FILE)
            self.hooks.report(row, d if self.rank == 0 else None)

    def state_dict(self) -> dict:
        """Everything an exact resume needs (the target's frozen embedding / LM head are left out: the target has
        them).  With --fsdp the same full (unsharded) state, gathered to rank 0 (collective; the others get empty
        model / optimizer entries)."""
        if self.fsdp:
            model, optimizer = full_state(self.model, self.optimizer)
        else:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {"model": {k: v for k, v in model.items() if not k.startswith(("embed_tokens", "lm_head"))},
                "optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "step": self.step,
                "positions_seen": self.positions_seen, "drafter_config": self.drafter_config.to_dict(),
                "draft_ids": self.plan["draft_ids"]}

    def load_state_dict(self, state: dict) -> None:
        """A state_dict() of either kind of run (replicated or --fsdp: the same format)."""
        if self.fsdp:
            load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.positions_seen = state.get("positions_seen", 0)

    def export(self) -> Path | None:
        """Rank 0: the trained drafter in the speculators / vLLM `method: dspark` format at <out>/drafter.  With
        --fsdp every rank calls it: the full weights are gathered into a plain drafter on rank 0's CPU."""
        model = self.model
        if self.fsdp:
            weights = full_model_state(self.model)
            if self.rank != 0:
                return None
            model = DSparkDrafter.from_target(self.drafter_config, self.target, draft_ids=self.draft_ids)
            model.load_state_dict(weights)
        path = export_checkpoint(model.cpu(), Path(self.cfg.out) / "drafter",
                                 verifier_name_or_path=str(self.target))
        print(f"[train] exported drafter checkpoint to {path}", flush=True)
        return path


# ---- the single-process launcher -------------------------------------------------------------------------------
class LocalCheckpoints(TrainerHooks):
    """--backend local: resume from a checkpoint folder; each checkpoint copied to <out>/checkpoints/step_<n>
    (through a .partial folder, so a crash never leaves a half-written one), the newest `keep` kept."""

    def __init__(self, out: Path, resume_from: Path | None = None, keep: int = 2):
        self.folder, self.resume_from, self.keep = Path(out) / LOCAL_CHECKPOINTS, resume_from, keep

    def load_state(self, map_location) -> dict | None:
        if self.resume_from is None:
            return None
        return torch.load(Path(self.resume_from) / STATE_FILE, map_location=map_location, weights_only=False)

    def report(self, row: dict, checkpoint: Path | None) -> None:
        if checkpoint is None:
            return
        dest = self.folder / f"step_{row['step']:08d}"
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(checkpoint, partial)
        shutil.rmtree(dest, ignore_errors=True)
        partial.rename(dest)
        for old in sorted(p for p in self.folder.glob("step_*") if not p.name.endswith(".partial"))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def train_local(plan: dict, resume_from: Path | None = None) -> bool:
    """The whole run in this process (no Ray): rank 0 of 1 on --device.  True when complete."""
    cfg = TrainConfig.from_plan(plan["train"])
    device = torch.device(resolve_device(cfg.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg.device}: PyTorch sees no CUDA device")
    print(f"[train] one process on {device}" + (" (bf16 autocast)" if use_bf16_autocast(cfg, device) else ""),
          flush=True)
    return Trainer(plan, Placement(0, 1, device), LocalCheckpoints(cfg.out, resume_from)).fit()
