"""Frozen weights in one block backed by transparent huge pages (CPU, Linux).

A decode step streams every weight matrix from memory once: SmolLM2's 540 MB of fp32 weights are ~135k pages of
4 KiB, a TLB miss every few microseconds.  Transparent huge pages (2 MiB) cover only memory that is 2 MiB-aligned and
advised MADV_HUGEPAGE (where the kernel's THP mode is ``madvise``).  Tensors allocated one by one are mmap'd at 4 KiB
alignment, so only part of each lands on huge pages, a share that differs between two target runners built the same
way in one process - a per-runner speed difference that depends on allocation luck.  :func:`arena_copy` lays
a set of tensors out back to back in ONE 2 MiB-aligned block advised before first touch, and
:func:`huge_page_fraction` reads the coverage back from ``/proc/self/smaps``.  The advice is a request: with free
2 MiB pages the kernel backs nearly all of the block; under memory pressure it may back none (measurements:
docs/results/speed_single_stream.md).
"""
from __future__ import annotations

import ctypes
import re
import sys

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE = 2 << 20
_ALIGN_BYTES = 64  # each tensor starts on a cache line


def _madvise_hugepage(addr: int, length: int) -> bool:
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def arena_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU, one dtype) back to back in one 2 MiB-aligned block advised MADV_HUGEPAGE before
    anything is written to it (so the kernel can back it with huge pages as the copies fault it in).  The copies are
    views of that block; it lives as long as any of them.  Same values, same shapes."""
    if not tensors:
        return []
    dt = tensors[0].dtype
    if any(t.dtype != dt or t.device.type != "cpu" for t in tensors):
        raise ValueError("arena_copy: all tensors must be CPU tensors of one dtype")
    es = tensors[0].element_size()
    align = max(1, _ALIGN_BYTES // es)
    sizes = [-(-t.numel() // align) * align for t in tensors]
    total = sum(sizes)
    buf = torch.empty(total + HUGE_PAGE // es, dtype=dt)  # untouched pages (no zero fill)
    start = (-buf.data_ptr()) % HUGE_PAGE // es
    body = buf[start:start + total]
    _madvise_hugepage(body.data_ptr(), (total * es) // HUGE_PAGE * HUGE_PAGE)  # whole huge pages inside the block
    out, pos = [], 0
    for t, n in zip(tensors, sizes):
        v = body[pos:pos + t.numel()].view(t.shape)
        v.copy_(t)
        out.append(v)
        pos += n
    return out


def huge_page_fraction(tensors: list[torch.Tensor]) -> float | None:
    """Share of the bytes of ``tensors`` that lie in memory mappings backed by huge pages (each mapping's
    AnonHugePages / size, weighted by the bytes of the tensors inside it); None where /proc/self/smaps is missing."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    vmas, cur = [], None
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            cur = [int(m.group(1), 16), int(m.group(2), 16), 0]
            vmas.append(cur)
        elif line.startswith("AnonHugePages:") and cur is not None:
            cur[2] = int(line.split()[1]) * 1024
    huge = total = 0.0
    for t in tensors:
        lo0 = t.data_ptr()
        hi0 = lo0 + t.numel() * t.element_size()
        for a, b, h in vmas:
            lo, hi = max(a, lo0), min(b, hi0)
            if lo < hi:
                total += hi - lo
                huge += (hi - lo) * h / (b - a)
    return huge / total if total else None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always`` / ``madvise`` / ``never``), None where unknown."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None
