"""Hidden-state store in a Mooncake distributed store (in-memory, shared by every process that reaches the master).

Keys, for a store ``prefix``:

    <prefix>/<sample_id>/<field>     raw tensor bytes (bf16 as its 16-bit pattern: bit-exact), one key per field
    <prefix>/<sample_id>/header      JSON {n_tokens, fields: {name: [dtype, shape, nbytes]}} -- put LAST: a sample is
                                     visible (get / done_ids) iff its header exists
    <prefix>/@index/<n>              writer registry: slot n holds a writer id (claimed first-wins)
    <prefix>/@index/<n>/ids          that writer's JSON {sample_id: n_tokens}, rewritten on flush()
    <prefix>/manifest                JSON, put LAST by commit(); removed again when a new sample is put

Semantics match :class:`pipeline.stores.disk.DiskHiddenStore`: put() of an existing id is a no-op, get() of an
unknown id raises KeyError, manifest() before commit raises StoreError, everything else fails with StoreError.
Objects are hard-pinned: Mooncake never evicts them, a full store fails the put with an error.

Memory: a store opened here contributes NO segment by default (``global_segment_size=0``): the memory is served by
a long-lived segment server that ``actors.mooncake_master.MooncakeMaster`` starts beside the master, so data outlives
the writer.  (A client's own segment, and every object in it, disappears when that client closes.)

This module takes the endpoint as plain strings (``master_addr``, ``metadata_url``) -- any object with those
attributes, a dict, or the MOONCAKE_MASTER_ADDR / MOONCAKE_METADATA_URL environment variables.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Iterable, Iterator

import numpy as np
import torch

from pipeline.stores.base import (OPTIONAL_FIELDS, TENSOR_FIELDS, HiddenStateStore, StoreError, tensor_from_bytes,
                                   tensor_to_bytes, validate_sample)
from pipeline.runtime import LOOPBACK, apply_env

ENV_MASTER_ADDR = "MOONCAKE_MASTER_ADDR"
ENV_METADATA_URL = "MOONCAKE_METADATA_URL"

HEADER = "header"
_DTYPE_NAME = {torch.int32: "int32", torch.uint8: "uint8", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPE = {v: k for k, v in _DTYPE_NAME.items()}

# Mooncake ErrorCode values (mooncake-store/include/types.h) met through the Python binding's int returns.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -700: "INVALID_WRITE", -701: "INVALID_READ",
    -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}
NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, RPC_FAIL = -200, -704, -900


def _endpoint_strings(endpoint, master_addr, metadata_url) -> tuple[str, str]:
    if endpoint is not None:
        if isinstance(endpoint, dict):
            master_addr, metadata_url = endpoint["master_addr"], endpoint["metadata_url"]
        else:
            master_addr, metadata_url = endpoint.master_addr, endpoint.metadata_url
    master_addr = master_addr or os.environ.get(ENV_MASTER_ADDR)
    metadata_url = metadata_url or os.environ.get(ENV_METADATA_URL)
    if not master_addr or not metadata_url:
        raise StoreError("no Mooncake endpoint: pass endpoint= (actors.mooncake_master.MooncakeEndpoint), or "
                         f"master_addr= and metadata_url=, or set {ENV_MASTER_ADDR} and {ENV_METADATA_URL}")
    return master_addr, metadata_url


def _tensor_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's bytes (no copy; bf16 as its bit pattern)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8)


class MooncakeHiddenStore(HiddenStateStore):
    """Hidden-state store in Mooncake.

    prefix              namespace of this store's keys (e.g. "hs/run1"); must not end with "/".
    endpoint            MooncakeEndpoint / dict / None (then master_addr+metadata_url or the environment).
    global_segment_size memory THIS client contributes to the store (default 0: use the master's segment server;
                        objects placed in this client's segment vanish when it closes).
    local_buffer_size   this client's transfer buffer (bounds one non-zero-copy batch).
    zero_copy           True: transfers go through a registered staging buffer (batch_put_from / batch_get_into);
                        False: put_batch / get_batch of bytes (the simple path).  Both are bit-exact.
    staging_bytes       initial size of that buffer; grows to fit the largest sample.
    writer_id           name of this writer's index (default: unique per instance); reuse one to resume its index.
    index_every         rewrite this writer's index every n puts (and on flush / commit / close).
    connect_timeout_s   how long to wait for the master's TCP port before failing (setup itself blocks ~90 s on an
                        absent master, so it is probed first).
    """

    def __init__(self, prefix: str, endpoint=None, *, master_addr: str | None = None, metadata_url: str | None = None,
                 global_segment_size: int = 0, local_buffer_size: int = 64 << 20, zero_copy: bool = True,
                 staging_bytes: int = 16 << 20, writer_id: str | None = None, index_every: int = 64,
                 hard_pin: bool = True, connect_timeout_s: float = 10.0, local_hostname: str = LOOPBACK):
        if not prefix or prefix.endswith("/"):
            raise StoreError(f"prefix must be non-empty and not end with '/', got {prefix!r}")
        self.prefix = prefix
        self.master_addr, self.metadata_url = _endpoint_strings(endpoint, master_addr, metadata_url)
        self.zero_copy = zero_copy
        self.index_every = max(1, index_every)
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._mine: dict[str, int] = {}  # sample id -> n_tokens, put (or found) by this instance
        self._index_dirty = 0
        self._slot: int | None = None
        self._staging: torch.Tensor | None = None
        self._staging_want = staging_bytes
        self._closed = False

        apply_env()  # MC_TCP_BIND_ADDRESS=127.0.0.1 etc. before the transfer engine starts
        host, _, port = self.master_addr.rpartition(":")
        self._check_reachable(host, int(port), connect_timeout_s)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, self.metadata_url, int(global_segment_size), int(local_buffer_size),
                               "tcp", "", self.master_addr)
        if rc != 0:
            raise StoreError(f"Mooncake setup failed (rc={rc}) for master {self.master_addr}, metadata "
                             f"{self.metadata_url}: is the master running (actors.mooncake_master.MooncakeMaster)?")
        self._cfg = ReplicateConfig()
        self._cfg.replica_num = 1
        if hard_pin:
            self._cfg.with_hard_pin = True

    def _check_reachable(self, host: str, port: int, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise StoreError(f"Mooncake master unreachable at {self.master_addr} ({e}); start one with "
                                     "actors.mooncake_master.MooncakeMaster or check the endpoint") from None
                time.sleep(0.2)

    # ---- keys / errors ----------------------------------------------------------------------------------------
    def _key(self, sample_id: str, field: str) -> str:
        return f"{self.prefix}/{sample_id}/{field}"

    @property
    def manifest_key(self) -> str:
        return f"{self.prefix}/manifest"

    def _slot_key(self, n: int) -> str:
        return f"{self.prefix}/@index/{n}"

    def _err(self, what: str, rc: int) -> StoreError:
        name = ERROR_NAMES.get(rc, "unknown error")
        if rc == NO_AVAILABLE_HANDLE:
            hint = ("the Mooncake store is FULL (no segment has room; objects are hard-pinned and never evicted): "
                    "start the master with a larger segment_bytes, or drop() finished stores")
        elif rc in (RPC_FAIL, -901):
            hint = f"the Mooncake master at {self.master_addr} is unreachable"
        else:
            hint = name
        return StoreError(f"{what}: Mooncake error {rc} ({name}) - {hint}")

    def _check_sid(self, sample_id: str):
        if not isinstance(sample_id, str) or not sample_id or sample_id.startswith("@") or sample_id == "manifest":
            raise StoreError(f"invalid sample id {sample_id!r} (non-empty string, not 'manifest', not '@...')")

    def _exists(self, key: str) -> bool:
        r = self._store.is_exist(key)
        if r < 0:
            raise self._err(f"is_exist({key})", r)
        return r == 1

    def _get_small(self, key: str) -> bytes | None:
        """A small object's bytes, None if absent."""
        b = self._store.get(key)
        if b:
            return bytes(b)
        if self._exists(key):  # exists but empty / not readable
            raise StoreError(f"{key}: exists but could not be read")
        return None

    def _staging_buf(self, nbytes: int) -> tuple[torch.Tensor, int]:
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                self._store.unregister_buffer(self._staging.data_ptr())
            size = max(self._staging_want, 1 << (max(nbytes, 1) - 1).bit_length())
            buf = torch.empty(size, dtype=torch.uint8)
            rc = self._store.register_buffer(buf.data_ptr(), size)
            if rc != 0:
                raise self._err(f"register_buffer({size})", rc)
            self._staging = buf
        return self._staging, self._staging.data_ptr()

    # ---- writer -------------------------------------------------------------------------------------------------
    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        T = validate_sample(sample_id, tensors)
        self._check_sid(sample_id)
        with self._lock:
            if sample_id in self._mine or self._exists(self._key(sample_id, HEADER)):
                self._mine.setdefault(sample_id, T)
                return
            names = list(TENSOR_FIELDS) + [n for n in OPTIONAL_FIELDS if n in tensors]
            all_views = [_tensor_view(tensors[n]) for n in names]
            all_sizes = [v.nbytes for v in all_views]
            # Mooncake refuses empty objects: a 0-byte field (T == 0) lives in the header only.
            nz = [i for i, nb in enumerate(all_sizes) if nb]
            keys = [self._key(sample_id, names[i]) for i in nz]
            views = [all_views[i] for i in nz]
            sizes = [all_sizes[i] for i in nz]
            # Fields are UPSERTED: leftovers of a writer that died before the header are overwritten.
            if not keys:
                pass
            elif self.zero_copy:
                buf, base = self._staging_buf(sum(sizes))
                flat = buf.numpy()
                ptrs, off = [], 0
                for v in views:
                    flat[off:off + v.nbytes] = v
                    ptrs.append(base + off)
                    off += v.nbytes
                rcs = self._store.batch_upsert_from(keys, ptrs, sizes, self._cfg)
                bad = [(k, r) for k, r in zip(keys, rcs) if r != 0]
                if bad:
                    raise self._err(f"put {sample_id}: {bad[0][0]}", bad[0][1])
            else:
                rc = self._store.upsert_batch(keys, [tensor_to_bytes(tensors[names[i]]) for i in nz], self._cfg)
                if rc != 0:
                    raise self._err(f"put {sample_id}", rc)
            header = {"n_tokens": T, "fields": {n: [_DTYPE_NAME[tensors[n].dtype], list(tensors[n].shape), s]
                                                for n, s in zip(names, all_sizes)}}
            rc = self._store.put(self._key(sample_id, HEADER), json.dumps(header).encode(), self._cfg)  # LAST
            if rc != 0:
                raise self._err(f"put {sample_id} header", rc)
            self._mine[sample_id] = T
            if self._index_dirty == 0:  # the store changed: an older manifest no longer describes it
                self._store.remove(self.manifest_key, True)
            self._index_dirty += 1
            if self._index_dirty >= self.index_every:
                self._write_index()

    def _claim_slot(self) -> int:
        """Register this writer: the first free @index/<n> slot, claimed first-wins (put never overwrites)."""
        me = self.writer_id.encode()
        n = 0
        while True:
            key = self._slot_key(n)
            if not self._exists(key):
                rc = self._store.put(key, me, self._cfg)
                if rc != 0:
                    raise self._err(f"claim index slot {key}", rc)
            for _ in range(50):  # a concurrent claim may still be in flight
                got = self._store.get(key)
                if got:
                    break
                time.sleep(0.01)
            if bytes(got) == me:
                return n
            n += 1

    def _write_index(self):
        if self._slot is None:
            # a writer that reuses writer_id finds its slot again
            for n, wid in self._writers():
                if wid == self.writer_id:
                    self._slot = n
                    old = self._get_small(self._slot_key(n) + "/ids")
                    if old:
                        for k, v in json.loads(old).items():
                            self._mine.setdefault(k, v)
                    break
            else:
                self._slot = self._claim_slot()
        rc = self._store.upsert(self._slot_key(self._slot) + "/ids", json.dumps(self._mine).encode(), self._cfg)
        if rc != 0:
            raise self._err("write index", rc)
        self._index_dirty = 0

    def _writers(self) -> list[tuple[int, str]]:
        out, n, chunk = [], 0, 64
        while True:
            keys = [self._slot_key(i) for i in range(n, n + chunk)]
            ex = self._store.batch_is_exist(keys)
            if any(r < 0 for r in ex):
                raise self._err("list writers", min(ex))
            present = [k for k, r in zip(keys, ex) if r == 1]
            if present:
                for k, b in zip(present, self._store.get_batch(present)):
                    out.append((int(k.rsplit("/", 1)[1]), bytes(b).decode()))
            if len(present) < chunk:
                return out
            n += chunk

    def flush(self) -> None:
        """Puts are visible at once; this rewrites this writer's index (what done_ids() lists)."""
        with self._lock:
            if self._index_dirty:
                self._write_index()

    def _index(self) -> dict[str, int]:
        """{sample id: n_tokens} over every writer's index plus this instance's puts."""
        ids: dict[str, int] = {}
        slots = [self._slot_key(n) + "/ids" for n, _ in self._writers()]
        if slots:
            for k, b in zip(slots, self._store.get_batch(slots)):
                if b:
                    ids.update(json.loads(bytes(b)))
        ids.update(self._mine)
        return ids

    def done_ids(self) -> set[str]:
        """Samples whose header exists (a sample put after its writer's last index write is re-put as a no-op)."""
        with self._lock:
            index = self._index()
            if not index:
                return set()
            sids = list(index)
            ex = self._store.batch_is_exist([self._key(s, HEADER) for s in sids])
            if any(r < 0 for r in ex):
                raise self._err("done_ids", min(ex))
            return {s for s, r in zip(sids, ex) if r == 1}

    def commit(self, meta: dict) -> dict:
        """Flush, then put the manifest LAST: meta + backend, prefix, sample_ids (sorted), num_rows, num_tokens."""
        with self._lock:
            self.flush()
            index = self._index()
            ids = sorted(self.done_ids())
            manifest = dict(meta, backend="mooncake", prefix=self.prefix, sample_ids=ids, num_rows=len(ids),
                            num_tokens=int(sum(index[s] for s in ids)))
            rc = self._store.upsert(self.manifest_key, json.dumps(manifest).encode(), self._cfg)
            if rc != 0:
                raise self._err("put manifest", rc)
            return manifest

    # ---- reader -------------------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        b = self._get_small(self.manifest_key)
        if b is None:
            raise StoreError(f"Mooncake store {self.prefix!r} has no manifest - the stage that writes it has not "
                             "finished (commit() not called)")
        return json.loads(b)

    def _headers(self, sample_ids: list[str]) -> list[dict]:
        keys = [self._key(s, HEADER) for s in sample_ids]
        out = []
        for sid, k, b in zip(sample_ids, keys, self._store.get_batch(keys)):
            if not b:
                if self._exists(k):
                    raise StoreError(f"sample {sid!r}: header exists but could not be read")
                raise KeyError(f"sample {sid!r} not in Mooncake store {self.prefix!r}")
            out.append(json.loads(bytes(b)))
        return out

    def get(self, sample_id: str) -> dict[str, torch.Tensor]:
        return self.get_many([sample_id])[0]

    def get_many(self, sample_ids: list[str]) -> list[dict[str, torch.Tensor]]:
        """Several samples in batched transfers (as many per transfer as the staging buffer holds)."""
        if not sample_ids:
            return []
        for s in sample_ids:
            if not isinstance(s, str) or not s:
                raise KeyError(f"sample {s!r} not in Mooncake store {self.prefix!r}")
        with self._lock:
            headers = self._headers(list(sample_ids))
            out: list[dict[str, torch.Tensor]] = []
            i = 0
            while i < len(sample_ids):  # group samples so that a group fits the staging buffer
                j, total = i, 0
                cap = max(self._staging_want, self._staging.numel() if self._staging is not None else 0)
                while j < len(sample_ids):
                    nb = sum(f[2] for f in headers[j]["fields"].values())
                    if j > i and total + nb > cap:
                        break
                    total += nb
                    j += 1
                out += self._fetch(sample_ids[i:j], headers[i:j], total)
                i = j
            return out

    def _fetch(self, sids: list[str], headers: list[dict], total: int) -> list[dict[str, torch.Tensor]]:
        keys, sizes, specs = [], [], []
        res: dict[str, dict[str, torch.Tensor]] = {s: {} for s in sids}
        for sid, h in zip(sids, headers):
            for name, (dt, shape, nb) in h["fields"].items():
                if nb == 0:  # never stored (Mooncake has no empty objects)
                    res[sid][name] = torch.empty(tuple(shape), dtype=_DTYPE[dt])
                    continue
                keys.append(self._key(sid, name))
                sizes.append(nb)
                specs.append((sid, name, _DTYPE[dt], tuple(shape)))
        if not keys:
            datas = []
        elif self.zero_copy:
            buf, base = self._staging_buf(total)
            flat = buf.numpy()
            offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
            rcs = self._store.batch_get_into(keys, [base + o for o in offs], sizes)
            for k, r, nb in zip(keys, rcs, sizes):
                if r != nb:
                    raise self._missing(k, r if r < 0 else OBJECT_NOT_FOUND, f"got {r} of {nb} bytes")
            datas = [flat[o:o + nb] for o, nb in zip(offs, sizes)]
        else:
            datas = self._store.get_batch(keys)
            for k, d, nb in zip(keys, datas, sizes):
                if len(d) != nb:
                    raise self._missing(k, OBJECT_NOT_FOUND, f"got {len(d)} of {nb} bytes")
        for (sid, name, dtype, shape), d in zip(specs, datas):
            res[sid][name] = tensor_from_bytes(d, dtype, shape)  # copies out of the staging buffer
        return [res[s] for s in sids]

    def _missing(self, key: str, rc: int, detail: str) -> StoreError:
        if rc == OBJECT_NOT_FOUND:
            return StoreError(f"{key}: header present but tensor missing ({detail}) - removed or lost with a "
                              "segment that went away")
        return self._err(f"get {key} ({detail})", rc)

    def iter_samples(self, ids: Iterable[str] | None = None, batch: int = 8
                     ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        ids = list(self.manifest()["sample_ids"] if ids is None else ids)
        for i in range(0, len(ids), batch):
            chunk = ids[i:i + batch]
            yield from zip(chunk, self.get_many(chunk))

    # ---- maintenance ------------------------------------------------------------------------------------------
    def drop(self) -> int:
        """Remove every key of this store (all samples, indexes, the manifest).  Returns the number removed."""
        with self._lock:
            n = self._store.remove_by_regex("^" + re.escape(self.prefix + "/"), True)
            self._mine.clear()
            self._index_dirty = 0
            self._slot = None
            if n < 0:
                raise self._err(f"drop {self.prefix}", n)
            return n

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                if self._staging is not None:
                    self._store.unregister_buffer(self._staging.data_ptr())
                    self._staging = None
                self._store.close()

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass
