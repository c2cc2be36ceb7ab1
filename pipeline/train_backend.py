"""Ray Train's torch back end, with the gradient all-reduce's listeners on loopback.

Ray Train's stock ``TorchConfig`` lets ``torch.distributed`` rendezvous through a TCPStore that rank 0 starts, and
that server listens on every interface (``*:port``; PyTorch has no bind-address option).  Traffic still goes to
127.0.0.1, but the port is open to the network.  ``LoopbackTorchConfig`` keeps everything on loopback when the
cluster is (Ray's node address is 127.0.0.1, see ``pipeline.runtime``):

* rank 0 binds a socket to 127.0.0.1 itself and hands it to a TCPStore server (``master_listen_fd``), kept alive
  in that worker process until the group shuts down;
* every rank -- rank 0 included -- joins as a client (``TORCHELASTIC_USE_AGENT_STORE=True``, the switch
  torchelastic uses when its agent hosts the store), through ``env://`` with MASTER_ADDR=127.0.0.1;
* gloo's own pair sockets bind the loopback interface (``GLOO_SOCKET_IFNAME``, unless the user set it).

On a cluster whose node address is not loopback, or with a non-gloo back end, it behaves exactly like
``TorchConfig``.  Uses Ray Train's private helpers; Ray is pinned (pyproject.toml).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

from ray.train.torch import TorchConfig
from ray.train.torch.config import (V1WorkerGroup, _set_torch_distributed_env_vars, _setup_torch_process_group,
                                    _TorchBackend, get_address_and_port)

from pipeline.runtime import LOOPBACK

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
    import torch.distributed as dist

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
    """Point this worker's ``env://`` rendezvous at the loopback store, as a client; gloo on loopback."""
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())


class _LoopbackTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config):
        addr, _ = worker_group.execute_single(0, get_address_and_port)
        if addr != LOOPBACK or backend_config.backend not in (None, "gloo"):
            return super().on_start(worker_group, backend_config)
        port = worker_group.execute_single(0, host_store_on_loopback)
        worker_group.execute(join_loopback_store, port=port)
        if not isinstance(worker_group, V1WorkerGroup):
            worker_group.execute(_set_torch_distributed_env_vars)
        import ray

        ray.get([worker_group.execute_single_async(rank, _setup_torch_process_group, backend="gloo",
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
    """``TorchConfig`` whose rendezvous store and gloo sockets listen on 127.0.0.1 only (module docstring)."""

    backend: str | None = "gloo"

    @property
    def backend_cls(self):
        return _LoopbackTorchBackend
