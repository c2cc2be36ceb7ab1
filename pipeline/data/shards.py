"""Crash-safe Parquet shard sets: the storage mechanism of every stage's on-disk output.

A shard set is a folder of ``part-NNNNN.parquet`` files plus ``manifest.json``.  Each shard is written to a temp
name and renamed into place, so a shard is either whole or absent; rows are keyed by a string id column and a key
is written in at most one shard (the writer only writes ids that no committed shard holds).  The manifest is written
LAST; its presence means the set is complete.  A rerun after a kill reads the ids of the committed shards and
produces only what is missing: no duplicates, no lost rows (DeepSpec's resume-by-line-count bug cannot happen).
"""
from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"
_PART = re.compile(r"^part-(\d{5})\.parquet$")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


class ShardSet:
    def __init__(self, folder: str | Path, key: str):
        self.folder = Path(folder)
        self.key = key
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".*.tmp"):  # leftovers of a killed writer: never visible, safe to drop
            stale.unlink(missing_ok=True)

    # ---- reading --------------------------------------------------------------------------------------------
    def shard_paths(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if _PART.match(p.name))

    def done_ids(self) -> set[str]:
        ids: set[str] = set()
        for p in self.shard_paths():
            col = pq.read_table(p, columns=[self.key]).column(self.key).to_pylist()
            dup = ids.intersection(col)
            if dup:
                raise RuntimeError(f"{self.folder}: ids in more than one shard: {sorted(dup)[:5]}")
            ids.update(col)
        return ids

    def has_manifest(self) -> bool:
        return (self.folder / MANIFEST).is_file()

    def manifest(self) -> dict:
        p = self.folder / MANIFEST
        if not p.is_file():
            raise FileNotFoundError(f"{self.folder}: no {MANIFEST} - the stage that writes it has not finished")
        return json.loads(p.read_text())

    def iter_tables(self, columns: list[str] | None = None) -> Iterator[pa.Table]:
        for p in self.shard_paths():
            yield pq.read_table(p, columns=columns)

    def iter_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        for t in self.iter_tables(columns):
            yield from t.to_pylist()

    # ---- writing --------------------------------------------------------------------------------------------
    def next_index(self) -> int:
        idx = [int(_PART.match(p.name).group(1)) for p in self.shard_paths()]
        return max(idx, default=-1) + 1

    def write_shard(self, table: pa.Table, row_group_size: int | None = None) -> Path:
        """Atomically add one shard.  Invalidates a manifest left by an earlier (now extended) run."""
        if self.key not in table.column_names:
            raise ValueError(f"shard table lacks key column {self.key!r}")
        (self.folder / MANIFEST).unlink(missing_ok=True)
        path = self.folder / f"part-{self.next_index():05d}.parquet"
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def write_manifest(self, meta: dict) -> dict:
        n = sum(pq.ParquetFile(p).metadata.num_rows for p in self.shard_paths())
        manifest = dict(meta, num_rows=n, shards=[p.name for p in self.shard_paths()])
        atomic_write_json(self.folder / MANIFEST, manifest)
        return manifest
