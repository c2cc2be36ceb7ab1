"""Hidden-state store on local/shared disk: Parquet shards, one row group per sample, manifest written last.

Tensors are stored as raw bytes (bf16 as its 16-bit pattern), so a read is bit-identical to what was put; a sample
is read alone through its row group (random access for training) without loading the shard.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.stores.base import (OPTIONAL_FIELDS, TENSOR_FIELDS, HiddenStateStore, StoreError, tensor_from_bytes,
                                   tensor_to_bytes, validate_sample)
from pipeline.data.shards import ShardSet

_SCHEMA = pa.schema([("sample_id", pa.string()), ("n_tokens", pa.int32()), ("aux_dim", pa.int32()),
                     ("hidden", pa.int32())] + [(name, pa.large_binary()) for name in TENSOR_FIELDS]
                    + [(name, pa.large_binary()) for name in OPTIONAL_FIELDS])  # optional: null when absent


class DiskHiddenStore(HiddenStateStore):
    def __init__(self, folder: str | Path, samples_per_shard: int = 64):
        self.shards = ShardSet(folder, key="sample_id")
        self.samples_per_shard = samples_per_shard
        self._pending: list[dict] = []
        self._done: set[str] | None = None
        self._index: dict[str, tuple[Path, int]] | None = None

    @property
    def folder(self) -> Path:
        return self.shards.folder

    # ---- writer ---------------------------------------------------------------------------------------------
    def done_ids(self) -> set[str]:
        if self._done is None:
            self._done = self.shards.done_ids()
        return set(self._done)

    def put(self, sample_id, tensors):
        T = validate_sample(sample_id, tensors)
        if sample_id in self.done_ids() or any(r["sample_id"] == sample_id for r in self._pending):
            return
        row = {"sample_id": sample_id, "n_tokens": T, "aux_dim": tensors["aux_hidden"].shape[1],
               "hidden": tensors["last_hidden"].shape[1]}
        row.update({name: tensor_to_bytes(tensors[name]) for name in TENSOR_FIELDS})
        row.update({name: tensor_to_bytes(tensors[name]) if name in tensors else None for name in OPTIONAL_FIELDS})
        self._pending.append(row)
        if len(self._pending) >= self.samples_per_shard:
            self.flush()

    def flush(self):
        if not self._pending:
            return
        table = pa.Table.from_pylist(self._pending, schema=_SCHEMA)
        self.shards.write_shard(table, row_group_size=1)
        self._done = self.done_ids() | {r["sample_id"] for r in self._pending}
        self._pending = []
        self._index = None

    def commit(self, meta: dict) -> dict:
        self.flush()
        ids = sorted(self.done_ids())
        tokens = sum(pq.read_table(p, columns=["n_tokens"]).column(0).to_numpy().sum()
                     for p in self.shards.shard_paths())
        return self.shards.write_manifest(dict(meta, backend="disk", sample_ids=ids, num_tokens=int(tokens)))

    # ---- reader ---------------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        try:
            return self.shards.manifest()
        except FileNotFoundError as e:
            raise StoreError(str(e)) from None

    def _build_index(self):
        index = {}
        for p in self.shards.shard_paths():
            ids = pq.read_table(p, columns=["sample_id"]).column(0).to_pylist()
            for rg, sid in enumerate(ids):
                index[sid] = (p, rg)
        self._index = index

    def get(self, sample_id):
        if self._index is None or sample_id not in self._index:
            self._build_index()
        if sample_id not in self._index:
            raise KeyError(f"sample {sample_id!r} not in {self.folder}")
        path, rg = self._index[sample_id]
        row = pq.ParquetFile(path).read_row_group(rg).to_pylist()[0]
        if row["sample_id"] != sample_id:
            raise StoreError(f"{path}: row group {rg} holds {row['sample_id']}, expected {sample_id}")
        T, A, H = row["n_tokens"], row["aux_dim"], row["hidden"]
        shapes = {"input_ids": (T,), "loss_mask": (T,), "aux_hidden": (T, A), "last_hidden": (T, H), "target_lse": (T,)}
        out = {name: tensor_from_bytes(row[name], dtype, shapes[name]) for name, (dtype, _) in TENSOR_FIELDS.items()}
        out.update({name: tensor_from_bytes(row[name], dtype, shapes[name])
                    for name, (dtype, _) in OPTIONAL_FIELDS.items() if row.get(name) is not None})
        return out

    def close(self):
        self.flush()
