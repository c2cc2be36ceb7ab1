"""The hidden-state store interface, the sample layout and the byte codec shared by both backends.

A *sample* is one response row of stage 1 run through the target:

    input_ids    int32  [T]          prompt + response token ids
    loss_mask    uint8  [T]          1 on assistant tokens (incl. end-of-turn)
    aux_hidden   bf16   [T, n*d]     the chosen target layers, concatenated in ascending layer-id order
    last_hidden  bf16   [T, d]       the target's final hidden state (after the final norm: the LM-head input)
    target_lse   fp32   [T]          optional: logsumexp of the target's full-vocabulary logits computed from the
                                     STORED (bf16) last_hidden - lets training skip the full-vocabulary pass

Writers are exactly-once per sample id and crash-safe: a sample is either fully visible or absent; the manifest
(written last) says the store is complete and records its metadata (target, layer ids, hidden size, sample ids).
Readers return bit-identical tensors whatever the backend.
"""
from __future__ import annotations

import abc
from typing import Iterable, Iterator

import numpy as np
import torch

TENSOR_FIELDS = {  # name -> (torch dtype, rank)
    "input_ids": (torch.int32, 1),
    "loss_mask": (torch.uint8, 1),
    "aux_hidden": (torch.bfloat16, 2),
    "last_hidden": (torch.bfloat16, 2),
}
OPTIONAL_FIELDS = {"target_lse": (torch.float32, 1)}


class StoreError(RuntimeError):
    pass


def validate_sample(sample_id: str, tensors: dict[str, torch.Tensor]) -> int:
    """Check names, dtypes, ranks and that all fields agree on T; return T."""
    if not sample_id or not isinstance(sample_id, str):
        raise StoreError(f"sample id must be a non-empty string, got {sample_id!r}")
    missing = set(TENSOR_FIELDS) - set(tensors)
    if missing:
        raise StoreError(f"sample {sample_id}: missing tensors {sorted(missing)}")
    unknown = set(tensors) - set(TENSOR_FIELDS) - set(OPTIONAL_FIELDS)
    if unknown:
        raise StoreError(f"sample {sample_id}: unknown tensors {sorted(unknown)}")
    T = None
    for name, (dtype, rank) in {**TENSOR_FIELDS, **OPTIONAL_FIELDS}.items():
        if name not in tensors:
            continue
        t = tensors[name]
        if t.dtype != dtype or t.dim() != rank:
            raise StoreError(f"sample {sample_id}: {name} must be {dtype} rank {rank}, got {t.dtype} {tuple(t.shape)}")
        T = t.shape[0] if T is None else T
        if t.shape[0] != T:
            raise StoreError(f"sample {sample_id}: {name} has {t.shape[0]} tokens, expected {T}")
    return int(T)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a contiguous CPU tensor (bf16 travels as its 16-bit pattern: bit-exact)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


_NP = {torch.int32: np.int32, torch.uint8: np.uint8, torch.bfloat16: np.int16, torch.float32: np.float32,
       torch.int64: np.int64, torch.float16: np.float16}


def tensor_from_bytes(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    arr = np.frombuffer(buf, dtype=_NP[dtype]).copy().reshape(shape)
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def bytes_per_token(n_aux_layers: int, hidden: int, with_lse: bool = True) -> int:
    """Stored bytes per token: 4 (id) + 1 (mask) + 2*n*d (aux) + 2*d (last) + 4 (target lse, if stored)."""
    return 5 + 2 * n_aux_layers * hidden + 2 * hidden + (4 if with_lse else 0)


class HiddenStateStore(abc.ABC):
    """Both sides of a hidden-state store.  Writers: put() then commit(manifest).  Readers: manifest(), get()."""

    # --- writer -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        """Store one sample atomically (visible whole or not at all).  Re-putting an existing id is a no-op."""

    def put_many(self, samples: Iterable[tuple[str, dict[str, torch.Tensor]]]) -> None:
        for sid, t in samples:
            self.put(sid, t)

    @abc.abstractmethod
    def flush(self) -> None:
        """Make everything put so far durable (disk: write the pending shard)."""

    @abc.abstractmethod
    def done_ids(self) -> set[str]:
        """Sample ids already durably stored (for resuming)."""

    @abc.abstractmethod
    def commit(self, meta: dict) -> dict:
        """Flush, then write the manifest LAST (meta + sample ids + counts).  Returns the manifest."""

    # --- reader -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def manifest(self) -> dict:
        """The committed manifest; raises StoreError if the store was never committed."""

    @abc.abstractmethod
    def get(self, sample_id: str) -> dict[str, torch.Tensor]:
        """One sample's tensors (see module doc).  Raises KeyError for an unknown id."""

    def iter_samples(self, ids: Iterable[str] | None = None) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        for sid in (self.manifest()["sample_ids"] if ids is None else ids):
            yield sid, self.get(sid)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

