"""Registered memory for Mooncake transfers: staging blocks for puts, and leased blocks that gets fill in place.

A Mooncake transfer reads from / writes into memory the client has registered.  Through a segment server (the
store's normal mode, see :mod:`pipeline.stores.mooncake`) that memory is POSIX shared memory the server maps too
(``alloc_from_mem_pool`` + ``register_buffer``), so a put or get is one memcpy in the server, no socket.

:class:`LeasePool` hands out blocks of such memory.  A :class:`Lease` is returned to its pool when the last numpy
array / torch tensor over it is garbage-collected: a get can give the caller tensors that ARE the transfer buffer
(no copy out), and the memory is reused once the caller drops them.

    pool = LeasePool(alloc)                       # alloc(nbytes) -> Arena (registered with the client)
    lease = pool.lease(n)                         # None never: the pool grows by a new arena when full
    rc = client.batch_get_into([key], [lease.addr], [lease.nbytes])
    lease.shrink(rc)                              # give the unused tail back
    t = torch.from_numpy(lease.array()[off:off + nb])   # alive as long as t (or any view of it) is
"""
from __future__ import annotations

import bisect
import collections
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

ALIGN = 64  # every block starts on a cache line


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class Arena:
    """One registered region: its address, size and a uint8 numpy view of it (the owner keeps it mapped)."""

    addr: int
    nbytes: int
    view: np.ndarray  # (nbytes,) uint8
    owner: object = None  # what keeps the memory alive (a torch tensor), None for shared memory mapped for good


class Lease:
    """``nbytes`` of an arena at ``addr``; numpy arrays from :meth:`array` keep it (and so the memory) leased."""

    __slots__ = ("_pool", "arena", "index", "offset", "nbytes")

    def __init__(self, pool: "LeasePool", arena: Arena, index: int, offset: int, nbytes: int):
        self._pool, self.arena, self.index, self.offset, self.nbytes = pool, arena, index, offset, nbytes

    @property
    def addr(self) -> int:
        return self.arena.addr + self.offset

    @property
    def __array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False), "version": 3}

    def array(self) -> np.ndarray:
        """(nbytes,) uint8 over the leased memory; its ``base`` is this lease."""
        return np.asarray(self)

    def shrink(self, nbytes: int) -> None:
        """Keep only the first ``nbytes`` (rounded up to ALIGN); the tail goes back to the pool now."""
        keep = align_up(max(nbytes, 1))
        if keep < self.nbytes:
            self._pool._release(self.index, self.offset + keep, self.nbytes - keep)
            self.nbytes = keep

    def __del__(self):
        pool = self._pool
        if pool is not None:
            pool._released.append((self.index, self.offset, self.nbytes))  # drained under the pool's lock


class LeasePool:
    """First-fit blocks over arenas from ``alloc``; grows by one arena of max(``arena_bytes``, request) when no
    arena has room.  Thread-safe; releases may come from any thread (garbage collection)."""

    def __init__(self, alloc: Callable[[int], Arena], arena_bytes: int):
        self._alloc = alloc
        self.arena_bytes = align_up(arena_bytes, 1 << 20)
        self.arenas: list[Arena] = []
        self._free: list[list[tuple[int, int]]] = []  # per arena: sorted (offset, size) free blocks
        self._released: collections.deque = collections.deque()
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return sum(a.nbytes for a in self.arenas)

    def free_bytes(self) -> int:
        with self._lock:
            self._drain()
            return sum(s for blocks in self._free for _, s in blocks)

    def lease(self, nbytes: int) -> Lease:
        need = align_up(max(nbytes, 1))
        with self._lock:
            self._drain()
            for i, blocks in enumerate(self._free):
                for j, (off, size) in enumerate(blocks):
                    if size >= need:
                        if size == need:
                            del blocks[j]
                        else:
                            blocks[j] = (off + need, size - need)
                        return Lease(self, self.arenas[i], i, off, need)
            arena = self._alloc(max(self.arena_bytes, align_up(need, 1 << 20)))
            self.arenas.append(arena)
            self._free.append([(need, arena.nbytes - need)] if arena.nbytes > need else [])
            return Lease(self, arena, len(self.arenas) - 1, 0, need)

    def _release(self, index: int, offset: int, size: int) -> None:
        self._released.append((index, offset, size))

    def _drain(self) -> None:
        while self._released:
            index, offset, size = self._released.popleft()
            blocks = self._free[index]
            k = bisect.bisect_left(blocks, (offset, 0))
            if k > 0 and blocks[k - 1][0] + blocks[k - 1][1] == offset:  # merge with the block before
                k -= 1
                offset, size = blocks[k][0], blocks[k][1] + size
                del blocks[k]
            if k < len(blocks) and offset + size == blocks[k][0]:  # and the one after
                size += blocks[k][1]
                del blocks[k]
            blocks.insert(k, (offset, size))
