"""Online hidden-state extraction (extraction decoupled from training, as vLLM's Kimi-K3 deployment ran it).

A pool of Ray actors, each holding a vLLM extractor (or the transformers fallback) and a Mooncake client, takes
sample requests (token ids + loss mask), runs the target, puts the tensors into the Mooncake store and answers with
the sample's key.  Consumers (training workers) fetch by key from any process through
``pipeline.stores.mooncake.MooncakeHiddenStore(prefix, endpoint).get(key)``: the hidden-state cache never has to
exist whole on disk.

    service = ExtractionService(target, layer_ids, endpoint, prefix="online/run1", num_workers=2)
    # one segment server per node: each worker puts through its own node's server (its samples stay there)
    service = ExtractionService(target, layer_ids, endpoint, "online/run1", 2, node_endpoints={node_id: ep, ...})
    keys = service.extract([{"request_id": "a", "input_ids": [...], "loss_mask": [...]}, ...])   # blocking
    refs = service.submit(batch)                                                                    # async
"""
from __future__ import annotations

import itertools

import numpy as np
import ray

from actors.extraction import _IN_SCHEMA, VLLMExtractor
from actors.mooncake_master import loopback_preload_env
from actors.vllm_engine import actor_runtime_env
from pipeline.launch.launch_plan import EngineLayout
from pipeline.launch.placement import INFERENCE, role_resources
from pipeline.stores.mooncake import MooncakeHiddenStore, tensor_bytes_view
from pipeline.data.target_model import num_layers


class _ExtractionWorker:
    def __init__(self, target: str, layer_ids: list[int], n_layers: int, max_model_len: int, endpoint: dict,
                 prefix: str, kind: str, node_endpoints: dict | None = None, layout: dict | None = None):
        self.node_id = ray.get_runtime_context().get_node_id()
        # this node's segment server when there is one per node: its puts stay on this node
        endpoint = (node_endpoints or {}).get(self.node_id, endpoint)
        self.extractor = VLLMExtractor(target, layer_ids, n_layers, max_model_len, kind=kind, layout=layout)
        self.store = MooncakeHiddenStore(prefix, endpoint)
        self.segment_server = self.store.segment_server

    def _sample_in_store(self, row: dict, aux_dim: int, hidden: int) -> dict:
        """The row's tensors decoded straight into the store's registered memory (no other copy on this side)."""
        out = self.store.alloc_sample(row["n_tokens"], aux_dim, hidden, with_lse=row.get("target_lse") is not None)
        for name, t in out.items():
            src = np.frombuffer(row[name], dtype=np.uint8)
            dst = tensor_bytes_view(t)
            if src.nbytes != dst.nbytes:
                raise ValueError(f"request {row['request_id']}: {name} has {src.nbytes} bytes, expected "
                                 f"{dst.nbytes} for {tuple(t.shape)} {t.dtype}")
            dst[:] = src
        return out

    def extract(self, requests: list[dict]) -> list[str]:
        """Run the target over ``requests``, put every sample (one batched transfer) and return their keys."""
        import pyarrow as pa

        table = self.extractor(pa.Table.from_pylist(requests, schema=_IN_SCHEMA))
        hidden = self.extractor.norm_w.shape[0]
        aux_dim = hidden * len(self.extractor.layer_ids)
        samples = [(row["request_id"], self._sample_in_store(row, aux_dim, hidden)) for row in table.to_pylist()]
        self.store.put_many(samples)
        self.store.flush()
        return [sid for sid, _ in samples]

    def ready(self) -> dict:
        return {"node_id": self.node_id, "segment_server": self.segment_server}


class ExtractionService:
    """Driver-side handle of the extraction actor pool (round-robin over workers)."""

    def __init__(self, target: str, layer_ids: list[int], endpoint, prefix: str, num_workers: int = 1,
                 max_model_len: int = 2048, kind: str = "vllm", num_cpus: float = 1.0, resources: dict | None = None,
                 node_endpoints: dict | None = None, layout: dict | None = None):
        """``layout``: the engine layout of every worker (``pipeline.launch.launch_plan.EngineLayout`` fields, e.g.
        ``{"gpus": 1}``: each worker asks Ray for that many GPUs and runs its vLLM engine on CUDA)."""
        ep = endpoint.to_dict() if hasattr(endpoint, "to_dict") else dict(endpoint)
        # the worker's Mooncake client must bind loopback only: the shim has to be preloaded at process start
        if resources is None:
            resources = role_resources(INFERENCE)
        gpus = EngineLayout(**layout).validate().gpus if layout else 0
        cls = ray.remote(num_cpus=num_cpus, num_gpus=gpus, resources=resources,
                         runtime_env=actor_runtime_env(None, loopback_preload_env({})))(_ExtractionWorker)
        per_node = {k: (v.to_dict() if hasattr(v, "to_dict") else dict(v)) for k, v in (node_endpoints or {}).items()}
        self.workers = [cls.remote(str(target), list(layer_ids), num_layers(target), max_model_len, ep, prefix, kind,
                                   per_node, layout) for _ in range(num_workers)]
        self.placement = ray.get([w.ready.remote() for w in self.workers])  # [{node_id, segment_server}] per worker
        self._next = itertools.cycle(self.workers)
        self.prefix = prefix

    def submit(self, requests: list[dict]):
        """Send one batch to the next worker; returns an ObjectRef of the keys."""
        return next(self._next).extract.remote(requests)

    def extract(self, requests: list[dict], batch_size: int = 8) -> list[str]:
        refs = [self.submit(requests[i:i + batch_size]) for i in range(0, len(requests), batch_size)]
        return [k for keys in ray.get(refs) for k in keys]

    def shutdown(self):
        for w in self.workers:
            ray.kill(w)
        self.workers = []
