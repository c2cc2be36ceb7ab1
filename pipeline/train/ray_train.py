"""Ray Train's side of training: the worker loop TorchTrainer runs, and its torch back end with the gradient
all-reduce's listeners on loopback.

``train_loop_per_worker(plan)`` builds pipeline.train.trainer.Trainer with Ray's hooks: rank and world size from the Train
context, the device from ``ray.train.torch.get_device()`` on GPU workers, the checkpoint to resume from (the newer of
Ray Train's own and jobs.train's --resume), checkpoints and metrics through ``ray.train.report``.
With --fsdp the same process group carries FSDP2's all-gathers and reduce-scatters instead of the gradient
all-reduce (pipeline/train/fsdp.py).

Ray Train's stock ``TorchConfig`` lets ``torch.distributed`` rendezvous through a TCPStore that rank 0 starts, and
that server listens on every interface (``*:port``; PyTorch has no bind-address option).  Traffic still goes to
127.0.0.1, but the port is open to the network.  ``LoopbackTorchConfig`` keeps everything on loopback when the
cluster is (Ray's node address is 127.0.0.1, see ``pipeline.core.runtime``):

* rank 0 binds a socket to 127.0.0.1 itself and hands it to a TCPStore server (``master_listen_fd``), kept alive
  in that worker process until the group shuts down;
* every rank -- rank 0 included -- joins as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, the switch
  torchelastic uses when its agent hosts the store), through ``env://`` with MASTER_ADDR=127.0.0.1;
* gloo's own pair sockets bind the loopback interface (``GLOO_SOCKET_IFNAME``, unless the user set it), and so
  does NCCL's bootstrap (``NCCL_SOCKET_IFNAME``) between GPU workers.

The back end is gloo between CPU workers and NCCL between GPU workers (``backend=None``, Ray's rule), or what
``backend`` names.  On a cluster whose node address is not loopback it behaves exactly like ``TorchConfig``.  Uses
Ray Train's private helpers; Ray is pinned (pyproject.toml).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train.torch.config import (V1WorkerGroup, _set_torch_distributed_env_vars, _setup_torch_process_group,
                                    _TorchBackend, get_address_and_port)

from pipeline.core.runtime import LOOPBACK
from pipeline.train.trainer import Placement, Trainer, TrainerHooks
from pipeline.train.config import STATE_FILE

# rank 0's (listening socket, TCPStore server); module state of that worker process, released on shutdown
_HOSTED_STORE: tuple | None = None


def loopback_interface() -> str:
    """Name of the loopback network interface (Linux "lo", macOS "lo0")."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name == "lo" or (name.startswith("lo") and name[2:].isdigit()):
            return name
    raise RuntimeError(f"no loopback interface among {names}")


def host_store_on_loopback() -> int:
    """Start the rendezvous TCPStore server on 127.0.0.1 in this process; returns its port."""
    global _HOSTED_STORE
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(LOOPBACK, port, None, True, timedelta(minutes=30), wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    _HOSTED_STORE = (sock, store)
    return port


def release_hosted_store() -> None:
    """Close rank 0's store server (after the process group is gone)."""
    global _HOSTED_STORE
    if _HOSTED_STORE is not None:
        sock, store = _HOSTED_STORE
        _HOSTED_STORE = None
        del store
        sock.close()


def join_loopback_store(port: int) -> None:
    """Point this worker's ``env://`` rendezvous at the loopback store, as a client; gloo's sockets and NCCL's
    bootstrap on the loopback interface."""
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())


def process_group_backend(worker_group, backend_config) -> str:
    """The configured back end, or Ray's rule: NCCL when the workers have GPUs, else gloo."""
    if backend_config.backend is not None:
        return backend_config.backend
    return "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"


class _LoopbackTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config):
        addr, _ = worker_group.execute_single(0, get_address_and_port)
        backend = process_group_backend(worker_group, backend_config)
        if addr != LOOPBACK or backend not in ("gloo", "nccl"):
            return super().on_start(worker_group, backend_config)
        port = worker_group.execute_single(0, host_store_on_loopback)
        worker_group.execute(join_loopback_store, port=port)
        if not isinstance(worker_group, V1WorkerGroup):
            worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(rank, _setup_torch_process_group, backend=backend,
                                                   world_rank=rank, world_size=len(worker_group),
                                                   init_method="env://", timeout_s=backend_config.timeout_s)
                 for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config):
        super().on_shutdown(worker_group, backend_config)
        try:
            worker_group.execute_single(0, release_hosted_store)
        except Exception:  # a dead worker's store died with it
            pass


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """``TorchConfig`` whose rendezvous store, gloo sockets and NCCL bootstrap listen on 127.0.0.1 only (module
    docstring).  backend None: NCCL between GPU workers, gloo between CPU workers."""

    backend: str | None = None

    @property
    def backend_cls(self):
        return _LoopbackTorchBackend


# ---- the worker loop ---------------------------------------------------------------------------------------------
class RayTrainHooks(TrainerHooks):
    """Resume from the newer of Ray Train's checkpoint and jobs.train's --resume folder; every report (and
    checkpoint) goes through ray.train.report, which Ray Train keeps under <out>/ray."""

    def __init__(self, resume_from: str | None):
        self.resume_from = resume_from

    def load_state(self, map_location) -> dict | None:
        """The later (by step) of two states: Ray Train's checkpoint -- the last one it registered for this run
        folder (restored from its storage at the start of a run), or the last one of this run when it restarts a
        failed worker group -- and the --resume folder (jobs.train's pick: the newest checkpoint on disk).  The two
        differ after a kill: a worker persists its checkpoint at once, but the controller registers it only when
        it takes the report (at its health check, every 2 s), so the newest checkpoints of a killed run are on disk
        and not in Ray Train's record."""
        best = None
        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                best = torch.load(Path(d) / STATE_FILE, map_location=map_location, weights_only=False)
        if self.resume_from:
            state = torch.load(Path(self.resume_from) / STATE_FILE, map_location=map_location, weights_only=False)
            if best is None or state["step"] > best["step"]:
                best = state
        return best

    def report(self, row: dict, checkpoint: Path | None) -> None:
        ray.train.report(row, checkpoint=ray.train.Checkpoint.from_directory(checkpoint) if checkpoint else None)


def quiet_ray_train_reports() -> None:
    """Ray Train v2 logs every ``ray.train.report`` at INFO ("Reporting training result N: TrainingReport(...)", the
    whole metrics dict) on a logger named by its file path, which ``LoggingConfig`` does not reach; our step lines
    already say it.  Raise that one logger to WARNING (in the worker process)."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray layout: nothing to quiet
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def train_loop_per_worker(plan: dict) -> None:
    """What TorchTrainer runs on each worker: pipeline.train.dataset.plan()'s dict (+ resume_from) -> Trainer.fit()."""
    quiet_ray_train_reports()
    ctx = ray.train.get_context()
    gpu = plan["train"]["gpus_per_worker"] > 0
    device = ray.train.torch.get_device() if gpu else torch.device("cpu")
    placement = Placement(rank=ctx.get_world_rank(), world=ctx.get_world_size(), device=device)
    Trainer(plan, placement, RayTrainHooks(plan.get("resume_from"))).fit()
