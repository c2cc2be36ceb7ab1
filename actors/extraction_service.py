"""Online hidden-state extraction (extraction decoupled from training, as vLLM's Kimi-K3 deployment ran it).

A pool of Ray actors, each holding a vLLM extractor (or the transformers fallback) and a Mooncake client, takes
sample requests (token ids + loss mask), runs the target, puts the tensors into the Mooncake store and answers with
the sample's key.  Consumers (training workers) fetch by key from any process through
``pipeline.stores.mooncake.MooncakeHiddenStore(prefix, endpoint).get(key)``: the hidden-state cache never has to
exist whole on disk.

    service = ExtractionService(target, layer_ids, endpoint, prefix="online/run1", num_workers=2)
    keys = service.extract([{"request_id": "a", "input_ids": [...], "loss_mask": [...]}, ...])   # blocking
    refs = service.submit(batch)                                                                    # async
"""
from __future__ import annotations

import itertools

import ray

from actors.extraction import VLLMExtractor, row_to_sample
from pipeline.placement import INFERENCE, role_resources


class _ExtractionWorker:
    def __init__(self, target: str, layer_ids: list[int], n_layers: int, max_model_len: int, endpoint: dict,
                 prefix: str, kind: str):
        from pipeline.stores.mooncake import MooncakeHiddenStore

        self.extractor = VLLMExtractor(target, layer_ids, n_layers, max_model_len, kind=kind)
        self.store = MooncakeHiddenStore(prefix, endpoint)
        self.aux_dim = None

    def extract(self, requests: list[dict]) -> list[str]:
        import pyarrow as pa

        from actors.extraction import _IN_SCHEMA

        table = self.extractor(pa.Table.from_pylist(requests, schema=_IN_SCHEMA))
        keys = []
        for row in table.to_pylist():
            hidden = self.extractor.norm_w.shape[0]
            sample = row_to_sample(row, hidden * len(self.extractor.layer_ids), hidden)
            self.store.put(row["request_id"], sample)
            keys.append(row["request_id"])
        self.store.flush()
        return keys

    def ready(self) -> bool:
        return True


class ExtractionService:
    """Driver-side handle of the extraction actor pool (round-robin over workers)."""

    def __init__(self, target: str, layer_ids: list[int], endpoint, prefix: str, num_workers: int = 1,
                 max_model_len: int = 2048, kind: str = "vllm", num_cpus: float = 1.0, resources: dict | None = None):
        from pipeline.target_model import num_layers

        from actors.mooncake_master import loopback_preload_env
        from actors.vllm_engine import actor_runtime_env

        ep = endpoint.to_dict() if hasattr(endpoint, "to_dict") else dict(endpoint)
        # the worker's Mooncake client must bind loopback only: the shim has to be preloaded at process start
        if resources is None:
            resources = role_resources(INFERENCE)
        cls = ray.remote(num_cpus=num_cpus, resources=resources,
                         runtime_env=actor_runtime_env(None, loopback_preload_env({})))(_ExtractionWorker)
        self.workers = [cls.remote(str(target), list(layer_ids), num_layers(target), max_model_len, ep, prefix, kind)
                        for _ in range(num_workers)]
        ray.get([w.ready.remote() for w in self.workers])
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
