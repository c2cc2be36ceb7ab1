"""A CPU-safe hidden-state connector for vLLM's ``extract_hidden_states`` speculative method.

vLLM's stock ``ExampleHiddenStatesConnector`` copies the cached hidden states with CUDA streams and pinned memory and
writes them to disk from a thread pool; on a CPU build that crashes.  This subclass overrides the one worker-side
method that does the copy: it slices the hidden states out of the cache synchronously and hands them to an
in-process registry (the engine runs in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), keyed by the path vLLM
returns in ``RequestOutput.kv_transfer_params["hidden_states_path"]``.  Nothing touches the disk.
"""
from __future__ import annotations

import threading

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)

_LOCK = threading.Lock()
_REGISTRY: dict[str, dict[str, torch.Tensor]] = {}


def pop_hidden_states(key: str) -> dict[str, torch.Tensor]:
    """Take the tensors saved for ``key`` (``hidden_states`` [T, n_layers, d], ``token_ids`` [T])."""
    with _LOCK:
        try:
            return _REGISTRY.pop(key)
        except KeyError:
            raise KeyError(f"no hidden states captured for {key!r} (is the engine running in-process?)") from None


def clear() -> None:
    with _LOCK:
        _REGISTRY.clear()


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_lock = False  # no files, no file locks

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        hs = extract_from_kv_cache(self._kv_cache, slots, n).clone()  # [n, n_layers, d]
        with _LOCK:
            _REGISTRY[pending.filename] = {"hidden_states": hs, "token_ids": pending.token_ids.clone()}

    def get_finished(self, finished_req_ids):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for pending in getattr(meta, "pending_saves", []):
                self._submit_async_write(pending)
        # everything is copied synchronously: every finished request is done sending at once
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = set(self._accumulated_finished_req_ids)
        self._accumulated_finished_req_ids.clear()
        return (done or None), None
