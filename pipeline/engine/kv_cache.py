"""The paged KV cache of the target runner: every layer's keys and values in one pool of fixed-size blocks, each
request (a *slot*) owning the list of blocks its positions fill (its block table).

    cache = PagedKVCache(layers=30, kv_heads=3, head_dim=64, max_tokens=45_000)
    s = cache.alloc()                 # an empty slot: no blocks yet
    cache.grow(s, 37)                 # blocks for positions 0..36 (3 blocks of 16)
    cache.truncate(s, 20)             # roll back to 20 positions: the third block goes back to the pool
    cache.free(s)

* Memory per request follows its own length: ``ceil(length / BLOCK)`` blocks, never a shared maximum.
* Rollback of rejected draft tokens is ``truncate``: positions past the new length are forgotten, whole blocks past
  it return to the pool.
* The pool is sized by a token budget (``max_tokens``, e.g. from a replica's memory budget); the tensors are
  allocated empty, so only the blocks in use are ever touched.  ``can_hold`` / ``grow`` tell an engine whether a
  request fits; ``CacheFull`` names what did not fit, so a caller queues instead of running out of memory.

Layouts (one layer; pipeline/ops/paged_attention.py reads them): keys ``[num_blocks, kv_heads, head_dim, BLOCK]``
(transposed inside a block), values ``[num_blocks, kv_heads, BLOCK, head_dim]``, fp32 or bf16 (``dtype``).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from pipeline.ops.paged_attention import BLOCK


class CacheFull(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class PagedKVCache:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_tokens: int, dtype=torch.float32,
                 device: str | torch.device = "cpu"):
        if max_tokens < BLOCK:
            raise ValueError(f"a KV cache of {max_tokens} tokens holds no block of {BLOCK}")
        self.num_blocks = max_tokens // BLOCK
        self.k = torch.empty(layers, self.num_blocks, kv_heads, head_dim, BLOCK, dtype=dtype, device=device)
        self.v = torch.empty(layers, self.num_blocks, kv_heads, BLOCK, head_dim, dtype=dtype, device=device)
        self.bytes_per_block = 2 * layers * kv_heads * head_dim * BLOCK * self.k.element_size()
        self._free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out the lowest
        self.tables: dict[int, list[int]] = {}  # slot -> its blocks, in position order
        self.lengths: dict[int, int] = {}  # slot -> positions held
        self._next_slot = 0
        self._free_slots: list[int] = []

    # ------------------------------------------------------------------ slots
    def alloc(self) -> int:
        s = self._free_slots.pop() if self._free_slots else self._new_slot()
        self.tables[s], self.lengths[s] = [], 0
        return s

    def _new_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def free(self, slot: int) -> None:
        if slot in self.tables:
            self._free_blocks.extend(reversed(self.tables.pop(slot)))
            del self.lengths[slot]
            self._free_slots.append(slot)

    @property
    def slots(self) -> set[int]:
        return set(self.tables)

    # ------------------------------------------------------------------ positions
    def length(self, slot: int) -> int:
        return self.lengths[slot]

    @staticmethod
    def blocks_for(tokens: int) -> int:
        return math.ceil(tokens / BLOCK)

    def free_tokens(self) -> int:
        return len(self._free_blocks) * BLOCK

    def can_hold(self, extra_blocks: int) -> bool:
        return extra_blocks <= len(self._free_blocks)

    def grow(self, slot: int, new_len: int) -> None:
        """Blocks for positions 0..new_len-1 of ``slot`` (its length is set by ``commit``); CacheFull if the pool
        has too few free blocks."""
        table = self.tables[slot]
        need = self.blocks_for(new_len) - len(table)
        if need > len(self._free_blocks):
            raise CacheFull(f"the KV cache needs {need} more blocks of {BLOCK} tokens for a request of {new_len} "
                            f"tokens and has {len(self._free_blocks)} free ({self.num_blocks} in all)")
        for _ in range(max(0, need)):
            table.append(self._free_blocks.pop())

    def commit(self, slot: int, new_len: int) -> None:
        self.lengths[slot] = new_len

    def truncate(self, slot: int, new_len: int) -> None:
        """Roll ``slot`` back to its first ``new_len`` positions; whole blocks past them return to the pool."""
        if not 0 <= new_len <= self.lengths[slot]:
            raise ValueError(f"truncate slot {slot} to {new_len}: cache holds {self.lengths[slot]}")
        self.lengths[slot] = new_len
        table = self.tables[slot]
        keep = self.blocks_for(new_len)
        while len(table) > keep:
            self._free_blocks.append(table.pop())

    def bytes_held(self, slot: int) -> int:
        return len(self.tables[slot]) * self.bytes_per_block

    # ------------------------------------------------------------------ a forward's layout
    def table_tensor(self, slots: Sequence[int]) -> torch.Tensor:
        """int32 [R, W]: the block tables of ``slots`` (padded with block 0, never read past a row's position)."""
        width = max(1, max(len(self.tables[s]) for s in slots))
        t = torch.zeros(len(slots), width, dtype=torch.int32)
        for i, s in enumerate(slots):
            if self.tables[s]:
                t[i, :len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        return t

    def locate(self, token_slots: Sequence[int], positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) int64 [N] of each (slot, position)."""
        blocks = [self.tables[s][p // BLOCK] for s, p in zip(token_slots, positions)]
        return torch.tensor(blocks, dtype=torch.long), torch.tensor([p % BLOCK for p in positions], dtype=torch.long)

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k / v [N, kv_heads, head_dim] into their (block, offset) of ``layer``."""
        self.k[layer][blocks, :, :, offsets] = k
        self.v[layer][blocks, :, offsets, :] = v
