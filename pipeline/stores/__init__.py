"""Hidden-state stores: one interface (``base.HiddenStateStore``), two backends, one factory.

    base.py      the sample layout, validation, the byte codec, the abstract store
    disk.py      DiskHiddenStore: Parquet shards, one row group per sample, manifest last
    mooncake.py  MooncakeHiddenStore: one object <prefix>/<id> per sample in a Mooncake store, manifest last

``open_hidden_store`` picks the backend a stage config names.  The Mooncake client library is imported only when
a Mooncake store is opened, so the disk path never needs it.  Imports ``core`` and ``data`` only.
"""
from __future__ import annotations

from pipeline.stores.base import (OPTIONAL_FIELDS, TENSOR_FIELDS, HiddenStateStore, StoreError, bytes_per_token,
                                  tensor_from_bytes, tensor_to_bytes, validate_sample)
from pipeline.stores.disk import DiskHiddenStore
from pipeline.stores.mooncake import MooncakeHiddenStore

BACKENDS = ("disk", "mooncake")


def open_hidden_store(backend: str, folder=None, prefix: str | None = None, endpoint=None,
                      master_addr: str | None = None, metadata_url: str | None = None) -> HiddenStateStore:
    """The store a stage config names: ``disk`` (a folder) or ``mooncake`` (a key prefix at a master given as an
    endpoint object/dict, as master_addr + metadata_url, or through the MOONCAKE_* environment variables)."""
    if backend == "disk":
        return DiskHiddenStore(folder)
    if backend == "mooncake":
        return MooncakeHiddenStore(prefix, endpoint, master_addr=master_addr, metadata_url=metadata_url)
    raise StoreError(f"unknown hidden-state backend {backend!r} ({' | '.join(BACKENDS)})")


__all__ = ["BACKENDS", "OPTIONAL_FIELDS", "TENSOR_FIELDS", "DiskHiddenStore", "HiddenStateStore", "MooncakeHiddenStore",
           "StoreError", "bytes_per_token", "open_hidden_store", "tensor_from_bytes",
           "tensor_to_bytes", "validate_sample"]
