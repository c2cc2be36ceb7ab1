"""Hidden-state store in a Mooncake distributed store (in-memory, shared by every process that reaches the master).

Keys, for a store ``prefix``:

    <prefix>/<sample_id>             ONE object per sample: a small header then every tensor's raw bytes (layout
                                     below).  A Mooncake object is visible only once its put completed, so a sample
                                     is visible whole or not at all
    <prefix>/@index/<n>              writer registry: slot n holds a writer id (claimed first-wins)
    <prefix>/@index/<n>/ids          that writer's JSON {sample_id: n_tokens}, rewritten on flush()
    <prefix>/manifest                JSON, put LAST by commit(); removed again when a new sample is put

Sample object layout (little-endian):

    b"DSHS" | uint32 header length H | header JSON (H bytes) | zero padding to 64 | field bytes, each at a 64-byte
    aligned offset.  header = {"n_tokens": T, "fields": {name: [dtype, shape, nbytes, offset]}}; bf16 travels as
    its 16-bit pattern (bit-exact).  A 0-byte field (T == 0) has no bytes, only its header entry.

Semantics match :class:`pipeline.stores.disk.DiskHiddenStore`: put() of an existing id is a no-op, get() of an
unknown id raises KeyError, manifest() before commit raises StoreError, everything else fails with StoreError.
Objects are hard-pinned: Mooncake never evicts them, a full store fails the put with an error.

Where the bytes go.  ``actors.mooncake_master.MooncakeMaster`` runs, next to the master, a long-lived *segment
server* (``mooncake_client``) that owns the store's memory, so data outlives its writer.  A store opened with that
server's address (``endpoint.segment_server``, the default whenever the endpoint has one) is a thin client of it:
its transfer buffers are POSIX shared memory the server maps as well, and a put or get is ONE memcpy inside the
server between that shared memory and the segment - no socket carries the payload.  A get hands back tensors that
are views of the shared memory it landed in (leased from :class:`pipeline.stores.mooncake_buffers.LeasePool`, reused
once the caller drops them), so the reader copies nothing either.  With several segment servers (one per node),
``endpoint.segment_name`` places a writer's objects in its own node's segment; a reader on another node then gets
them through its own server, which fetches over the transfer engine (TCP): the only network crossing.  Without a
segment server address the store falls back to a full client of its own (``global_segment_size`` of memory, 0 by
default) whose every transfer crosses TCP to wherever the object lives.

This module takes the endpoint as plain strings (``master_addr``, ``metadata_url``, ``segment_server``,
``segment_name``) -- any object with those attributes, a dict, or the MOONCAKE_* environment variables.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.request
import uuid
from typing import Iterable, Iterator

import numpy as np
import torch

from pipeline.stores.base import (OPTIONAL_FIELDS, TENSOR_FIELDS, HiddenStateStore, StoreError, tensor_from_bytes,
                                   validate_sample)
from pipeline.stores.mooncake_buffers import ALIGN, Arena, Lease, LeasePool, align_up
from pipeline.core.runtime import LOOPBACK, MOONCAKE_PROTOCOL_ENV, MOONCAKE_PROTOCOLS, apply_env

ENV_MASTER_ADDR = "MOONCAKE_MASTER_ADDR"
ENV_METADATA_URL = "MOONCAKE_METADATA_URL"
ENV_SEGMENT_SERVER = "MOONCAKE_SEGMENT_SERVER"
ENV_SEGMENT_NAME = "MOONCAKE_SEGMENT_NAME"

# where actors.mooncake_master.MooncakeMaster publishes its segment server at the metadata server (URL-quoted key)
SEGMENT_SERVER_KEY = "dspark%2Fsegment_server"

MAGIC = b"DSHS"
_PREAMBLE = struct.Struct("<4sI")  # magic, header length
_DTYPE_NAME = {torch.int32: "int32", torch.uint8: "uint8", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPE = {v: k for k, v in _DTYPE_NAME.items()}
_NP_OF = {torch.int32: np.int32, torch.uint8: np.uint8, torch.bfloat16: np.int16, torch.float32: np.float32}

# Mooncake ErrorCode values (mooncake-store/include/types.h) met through the Python binding's int returns.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -700: "INVALID_WRITE", -701: "INVALID_READ",
    -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}
NO_AVAILABLE_HANDLE, INVALID_PARAMS, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, RPC_FAIL = -200, -600, -704, -705, -900


def _endpoint_strings(endpoint, master_addr, metadata_url, segment_server, segment_name) -> tuple[str, str, str, str]:
    if endpoint is not None:
        get = endpoint.get if isinstance(endpoint, dict) else lambda k, d=None: getattr(endpoint, k, d)
        master_addr, metadata_url = get("master_addr"), get("metadata_url")
        segment_server = segment_server if segment_server is not None else get("segment_server", "")
        segment_name = segment_name if segment_name is not None else get("segment_name", "")
    master_addr = master_addr or os.environ.get(ENV_MASTER_ADDR)
    metadata_url = metadata_url or os.environ.get(ENV_METADATA_URL)
    if segment_server is None:
        segment_server = os.environ.get(ENV_SEGMENT_SERVER, "")
    if segment_name is None:
        segment_name = os.environ.get(ENV_SEGMENT_NAME, "")
    if not master_addr or not metadata_url:
        raise StoreError("no Mooncake endpoint: pass endpoint= (actors.mooncake_master.MooncakeEndpoint), or "
                         f"master_addr= and metadata_url=, or set {ENV_MASTER_ADDR} and {ENV_METADATA_URL}")
    return master_addr, metadata_url, segment_server or "", segment_name or ""


def transfer_protocol() -> str:
    """The transfer engine's protocol for a client that mounts its own segment: tcp, or rdma where the extract job
    chose it (``--mooncake-protocol``, handed over as DSPARK_MOONCAKE_PROTOCOL)."""
    p = os.environ.get(MOONCAKE_PROTOCOL_ENV, "tcp")
    if p not in MOONCAKE_PROTOCOLS:
        raise StoreError(f"{MOONCAKE_PROTOCOL_ENV}={p!r}: expected one of {MOONCAKE_PROTOCOLS}")
    return p


def discover_segment_server(metadata_url: str, timeout: float = 2.0) -> tuple[str, str]:
    """(segment server, segment name) that the master's launcher published at ``metadata_url``; ("", "") if none."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(f"{metadata_url}?key={SEGMENT_SERVER_KEY}", timeout=timeout) as r:
            d = json.loads(r.read())
        return str(d.get("segment_server", "")), str(d.get("segment_name", ""))
    except (OSError, ValueError, AttributeError):
        return "", ""


def tcp_reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def split_host_port(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port); StoreError names a malformed address."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise StoreError(f"expected host:port, got {addr!r}")
    return host, int(port)


def _reachable(addr: str, timeout: float = 1.0) -> bool:
    try:
        return tcp_reachable(*split_host_port(addr), timeout=timeout)
    except StoreError:
        return False


def tensor_bytes_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes (no copy; bf16 as its bit pattern)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise StoreError(f"need a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1).view(np.uint8)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (a copy only if it is not contiguous; bf16 as its bit pattern)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8)


def _object_layout(n_tokens: int, specs: list[tuple[str, torch.dtype, tuple[int, ...], int]]
                   ) -> tuple[bytes, list[int], int]:
    """(preamble + header bytes, each field's offset, object size) for fields ``specs`` = [(name, dtype, shape,
    nbytes)] (see module doc).  The offsets depend on the header's own length: laid out until it is stable."""
    guess = 0
    while True:
        off = align_up(_PREAMBLE.size + guess)
        offsets, fields = [], {}
        for name, dtype, shape, nb in specs:
            fields[name] = [_DTYPE_NAME[dtype], list(shape), nb, off]
            offsets.append(off)
            off = align_up(off + nb)
        header = json.dumps({"n_tokens": n_tokens, "fields": fields}, separators=(",", ":")).encode()
        if align_up(_PREAMBLE.size + len(header)) == align_up(_PREAMBLE.size + guess):
            break
        guess = len(header)
    head = _PREAMBLE.pack(MAGIC, len(header)) + header
    end = offsets[-1] + specs[-1][3] if specs else 0
    return head, offsets, max(end, len(head))


class _Layout:
    """Where each field of one sample sits in its object, and the tensors' bytes to copy there."""

    def __init__(self, sample_id: str, tensors: dict[str, torch.Tensor]):
        self.n_tokens = validate_sample(sample_id, tensors)
        self.names = list(TENSOR_FIELDS) + [n for n in OPTIONAL_FIELDS if n in tensors]
        self.tensors = tensors
        specs = [(n, tensors[n].dtype, tuple(tensors[n].shape), tensors[n].numel() * tensors[n].element_size())
                 for n in self.names]
        self.header, self.offsets, self.nbytes = _object_layout(self.n_tokens, specs)

    def in_place(self) -> "Lease | None":
        """The lease holding this sample already laid out as its object (tensors from alloc_sample), else None."""
        lease = getattr(self.tensors["input_ids"], "_mooncake_lease", None)
        if lease is None or lease.nbytes < self.nbytes:
            return None
        for n, off in zip(self.names, self.offsets):
            t = self.tensors[n]
            if getattr(t, "_mooncake_lease", None) is not lease or (t.numel() and t.data_ptr() != lease.addr + off):
                return None
        if bytes(lease.array()[:len(self.header)]) != self.header:
            return None
        return lease

    def write_into(self, dst: np.ndarray) -> None:
        """Copy header and fields into ``dst`` (uint8, >= nbytes)."""
        dst[:len(self.header)] = np.frombuffer(self.header, dtype=np.uint8)
        for n, off in zip(self.names, self.offsets):
            v = _as_bytes(self.tensors[n])
            dst[off:off + v.nbytes] = v

    def to_bytes(self) -> bytes:
        out = np.zeros(self.nbytes, dtype=np.uint8)
        self.write_into(out)
        return out.tobytes()


def _decode(key: str, buf: np.ndarray, copy: bool) -> dict[str, torch.Tensor]:
    """The tensors of one sample object in ``buf`` (uint8).  copy=False: views of ``buf`` (they keep it alive)."""
    if buf.nbytes < _PREAMBLE.size:
        raise StoreError(f"{key}: object of {buf.nbytes} bytes is not a hidden-state sample")
    magic, hlen = _PREAMBLE.unpack(buf[:_PREAMBLE.size].tobytes())
    if magic != MAGIC or _PREAMBLE.size + hlen > buf.nbytes:
        raise StoreError(f"{key}: not a hidden-state sample object (bad magic / header length)")
    header = json.loads(buf[_PREAMBLE.size:_PREAMBLE.size + hlen].tobytes())
    out = {}
    for name, (dt, shape, nb, off) in header["fields"].items():
        dtype = _DTYPE[dt]
        if nb == 0:
            out[name] = torch.empty(tuple(shape), dtype=dtype)
            continue
        if off + nb > buf.nbytes:
            raise StoreError(f"{key}: field {name} runs past the end of the object ({off + nb} > {buf.nbytes})")
        raw = buf[off:off + nb]
        if copy:
            out[name] = tensor_from_bytes(raw, dtype, shape)
        else:
            t = torch.from_numpy(raw.view(_NP_OF[dtype]).reshape(shape))
            out[name] = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
    return out


class MooncakeHiddenStore(HiddenStateStore):
    """Hidden-state store in Mooncake.

    prefix              namespace of this store's keys (e.g. "hs/run1"); must not end with "/".
    endpoint            MooncakeEndpoint / dict / None (then master_addr+metadata_url or the environment).
    segment_server      "host:port" of the segment server to work through (default: the endpoint's, else the
                        environment's, else the one published at the metadata server); "" = none, then this store is
                        a full client of its own (every transfer over TCP).
    segment_name        the segment new samples are placed in (default: the endpoint's; "" = the master chooses).
    global_segment_size memory a full client contributes (default 0; objects in it vanish when it closes).
    local_buffer_size   the client's own transfer buffer (carries the small JSON objects and zero_copy=False gets).
    zero_copy           True: samples travel through registered buffers (batch_put_from / batch_get_into), and a
                        get returns views of the buffer it landed in; False: put_batch / get_batch of bytes and
                        fresh tensors.  Both are bit-exact and read each other's objects.
    read_pool_bytes     the first arena of the get buffer pool (it grows while callers hold on to tensors).
    writer_id           name of this writer's index (default: unique per instance); reuse one to resume its index.
    index_every         rewrite this writer's index every n puts (and on flush / commit / close).
    connect_timeout_s   how long to wait for the master's (and segment server's) TCP port before failing (setup
                        itself blocks ~90 s on an absent master, so it is probed first).
    """

    def __init__(self, prefix: str, endpoint=None, *, master_addr: str | None = None, metadata_url: str | None = None,
                 segment_server: str | None = None, segment_name: str | None = None, global_segment_size: int = 0,
                 local_buffer_size: int = 16 << 20, zero_copy: bool = True, read_pool_bytes: int = 32 << 20,
                 writer_id: str | None = None, index_every: int = 64, hard_pin: bool = True,
                 connect_timeout_s: float = 10.0, local_hostname: str = LOOPBACK):
        if not prefix or prefix.endswith("/"):
            raise StoreError(f"prefix must be non-empty and not end with '/', got {prefix!r}")
        self.prefix = prefix
        self.master_addr, self.metadata_url, self.segment_server, self.segment_name = _endpoint_strings(
            endpoint, master_addr, metadata_url, segment_server, segment_name)

        self.zero_copy = zero_copy
        self.index_every = max(1, index_every)
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._mine: dict[str, int] = {}  # sample id -> n_tokens, put (or found) by this instance
        self._index_dirty = 0
        self._slot: int | None = None
        self._staging: Arena | None = None
        self._read_pool_bytes = read_pool_bytes
        self._pool: LeasePool | None = None
        self._size_guess = 1 << 20  # first guess of an object's size for a get; tracks the largest seen
        self._closed = True

        apply_env()  # MC_TCP_BIND_ADDRESS=127.0.0.1 etc. before the transfer engine starts
        self._check_reachable("master", self.master_addr, connect_timeout_s)
        if not self.segment_server and segment_server is None and not global_segment_size:
            # only the master's addresses (e.g. --mooncake-master): the segment server its launcher published, if
            # this process reaches it (it is on this host)
            found, found_name = discover_segment_server(self.metadata_url)
            if found and _reachable(found):
                self.segment_server, self.segment_name = found, self.segment_name or found_name
        self.via_segment_server = bool(self.segment_server) and not global_segment_size
        if self.via_segment_server:
            self._check_reachable("segment server", self.segment_server, connect_timeout_s)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._store = MooncakeDistributedStore()
        if self.via_segment_server:
            rc = self._store.setup_dummy(int(local_buffer_size), int(local_buffer_size), self.segment_server)
            where = f"segment server {self.segment_server}"
        else:
            rc = self._store.setup(local_hostname, self.metadata_url, int(global_segment_size),
                                   int(local_buffer_size), transfer_protocol(), "", self.master_addr)
            where = f"master {self.master_addr}, metadata {self.metadata_url}"
        if rc != 0:
            raise StoreError(f"Mooncake setup failed (rc={rc}) for {where}: is the master running "
                             "(actors.mooncake_master.MooncakeMaster)?")
        self._closed = False
        self._cfg = ReplicateConfig()
        self._cfg.replica_num = 1
        if hard_pin:
            self._cfg.with_hard_pin = True
        if self.segment_name:
            self._cfg.preferred_segment = self.segment_name

    def _check_reachable(self, what: str, addr: str, timeout: float):
        host, port = split_host_port(addr)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise StoreError(f"Mooncake {what} unreachable at {addr} ({e}); start one with "
                                     "actors.mooncake_master.MooncakeMaster or check the endpoint") from None
                time.sleep(0.2)

    # ---- keys / errors ----------------------------------------------------------------------------------------
    def _key(self, sample_id: str) -> str:
        return f"{self.prefix}/{sample_id}"

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
        elif rc in (RPC_FAIL, -901, -1):
            hint = (f"the Mooncake master at {self.master_addr}"
                    + (f" or the segment server at {self.segment_server}" if self.via_segment_server else "")
                    + (" is unreachable" if rc != -1 else " may have gone away"))
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

    # ---- registered memory --------------------------------------------------------------------------------------
    def _alloc_arena(self, nbytes: int) -> Arena:
        """``nbytes`` of memory registered with this client (shared with the segment server when there is one)."""
        if self.via_segment_server:
            addr = self._store.alloc_from_mem_pool(nbytes)
            if not addr:
                raise StoreError(f"could not allocate {nbytes} bytes of shared memory for Mooncake transfers")
            owner = None  # mapped until the process exits (tensors handed out may outlive this store)
            view = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=np.uint8)
        else:
            owner = torch.empty(nbytes, dtype=torch.uint8)
            addr, view = owner.data_ptr(), owner.numpy()
        rc = self._store.register_buffer(addr, nbytes)
        if rc != 0:
            raise self._err(f"register_buffer({nbytes})", rc)
        return Arena(addr, nbytes, view, owner)

    def _staging_for(self, nbytes: int) -> Arena:
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                self._store.unregister_buffer(self._staging.addr)
                self._staging = None
            self._staging = self._alloc_arena(max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length()))
        return self._staging

    def _read_pool(self) -> LeasePool:
        if self._pool is None:
            self._pool = LeasePool(self._alloc_arena, self._read_pool_bytes)
        return self._pool

    # ---- writer -------------------------------------------------------------------------------------------------
    def alloc_sample(self, n_tokens: int, aux_dim: int, hidden: int, with_lse: bool = False
                     ) -> dict[str, torch.Tensor]:
        """Empty tensors of one sample (input_ids [T], loss_mask [T], aux_hidden [T, aux_dim], last_hidden
        [T, hidden], target_lse [T] if ``with_lse``) laid out in registered memory exactly as its object: a
        producer that fills them in place and put()s them (unchanged, same store) is copied by nobody but the
        segment server.  Anything else put() copies as usual."""
        if not self.zero_copy:
            raise StoreError("alloc_sample needs zero_copy=True")
        T = int(n_tokens)
        shapes = {"input_ids": (T,), "loss_mask": (T,), "aux_hidden": (T, int(aux_dim)),
                  "last_hidden": (T, int(hidden)), **({"target_lse": (T,)} if with_lse else {})}
        dtypes = {**{k: v[0] for k, v in TENSOR_FIELDS.items()}, **{k: v[0] for k, v in OPTIONAL_FIELDS.items()}}
        specs = [(n, dtypes[n], shp, int(np.prod(shp)) * torch.empty(0, dtype=dtypes[n]).element_size())
                 for n, shp in shapes.items()]
        head, offsets, nbytes = _object_layout(T, specs)
        with self._lock:
            lease = self._read_pool().lease(nbytes)
        buf = lease.array()
        buf[:len(head)] = np.frombuffer(head, dtype=np.uint8)
        out = {}
        for (name, dtype, shp, nb), off in zip(specs, offsets):
            t = torch.from_numpy(buf[off:off + nb].view(_NP_OF[dtype]).reshape(shp))
            t = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
            t._mooncake_lease = lease
            out[name] = t
        return out

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> None:
        self.put_many([(sample_id, tensors)])

    def put_many(self, samples: Iterable[tuple[str, dict[str, torch.Tensor]]]) -> None:
        """Put several samples in one batched transfer (each still visible whole or not at all)."""
        todo: dict[str, _Layout] = {}
        for sid, tensors in samples:
            layout = _Layout(sid, tensors)
            self._check_sid(sid)
            if sid not in todo:
                todo[sid] = layout
        with self._lock:
            for sid in [s for s in todo if s in self._mine]:
                del todo[sid]  # already put by this instance: no-op
            if not todo:
                return
            sids, layouts = list(todo), list(todo.values())
            keys = [self._key(s) for s in sids]
            # Mooncake's put of an existing key leaves the stored object as it is: re-putting is a no-op
            if self.zero_copy:
                addrs: list[int | None] = []
                total = 0
                for lay in layouts:
                    lease = lay.in_place()
                    addrs.append(lease.addr if lease is not None else None)
                    if lease is None:
                        total = align_up(total + lay.nbytes, ALIGN)
                if total:  # samples in ordinary memory are copied into the staging buffer
                    buf, off = self._staging_for(total), 0
                    for i, lay in enumerate(layouts):
                        if addrs[i] is None:
                            lay.write_into(buf.view[off:off + lay.nbytes])
                            addrs[i] = buf.addr + off
                            off = align_up(off + lay.nbytes, ALIGN)
                rcs = self._store.batch_put_from(keys, addrs, [lay.nbytes for lay in layouts], self._cfg)
                bad = [(k, r) for k, r in zip(keys, rcs) if r not in (0, OBJECT_ALREADY_EXISTS)]
                if bad:
                    raise self._err(f"put {bad[0][0]}", bad[0][1])
            else:
                rc = self._store.put_batch(keys, [lay.to_bytes() for lay in layouts], self._cfg)
                if rc not in (0, OBJECT_ALREADY_EXISTS):
                    raise self._err(f"put {keys[0]}" + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else ""), rc)
            for sid, lay in zip(sids, layouts):
                self._mine[sid] = lay.n_tokens
            if self._index_dirty == 0:  # the store changed: an older manifest no longer describes it
                self._store.remove(self.manifest_key, True)
            self._index_dirty += len(sids)
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
        """Indexed samples whose object exists (a sample put after its writer's last index write is re-put as a
        no-op)."""
        with self._lock:
            index = self._index()
            if not index:
                return set()
            sids = list(index)
            ex = self._store.batch_is_exist([self._key(s) for s in sids])
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

    def get(self, sample_id: str) -> dict[str, torch.Tensor]:
        return self.get_many([sample_id])[0]

    def get_many(self, sample_ids: list[str]) -> list[dict[str, torch.Tensor]]:
        """Several samples in one batched transfer.  zero_copy: the tensors are views of leased shared memory."""
        if not sample_ids:
            return []
        for s in sample_ids:
            if not isinstance(s, str) or not s:
                raise KeyError(f"sample {s!r} not in Mooncake store {self.prefix!r}")
        keys = [self._key(s) for s in sample_ids]
        with self._lock:
            if not self.zero_copy:
                out = []
                for sid, k, b in zip(sample_ids, keys, self._store.get_batch(keys)):
                    if not b:
                        self._raise_missing(sid, k, OBJECT_NOT_FOUND)
                    out.append(_decode(k, np.frombuffer(b, dtype=np.uint8), copy=True))
                return out
            pool = self._read_pool()
            leases = [pool.lease(self._size_guess) for _ in keys]
            rcs = self._store.batch_get_into(keys, [le.addr for le in leases], [le.nbytes for le in leases])
            out = []
            for sid, k, le, rc in zip(sample_ids, keys, leases, rcs):
                if rc == INVALID_PARAMS:  # the buffer was too small for this object: size it, then fetch alone
                    size = self._store.get_size(k)
                    if size < 0:
                        self._raise_missing(sid, k, size)
                    self._size_guess = max(self._size_guess, align_up(size))
                    le = pool.lease(size)
                    rc = self._store.batch_get_into([k], [le.addr], [le.nbytes])[0]
                if rc < 0:
                    self._raise_missing(sid, k, rc)
                le.shrink(rc)
                out.append(_decode(k, le.array()[:rc], copy=False))
            return out

    def _raise_missing(self, sid: str, key: str, rc: int):
        if rc == OBJECT_NOT_FOUND:
            raise KeyError(f"sample {sid!r} not in Mooncake store {self.prefix!r}")
        raise self._err(f"get {key}", rc)

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
                self._store.close()  # shared memory stays mapped here: tensors handed out stay valid

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass
