"""Reduced draft vocabulary: the V_d most frequent target tokens of the training responses.

The drafter's lm_head and markov_w2 only have V_d rows; draft index i is target id draft_ids[i] (strictly increasing),
exported as `d2t` with target = i + d2t[i] (vLLM / speculators convention).  Chosen by coverage of response-token
occurrences (default 0.99) or by an explicit size; special tokens (eos, mask, ...) are always included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class DraftVocab:
    draft_ids: torch.Tensor  # [V_d] int64 target ids, strictly increasing
    vocab_size: int  # V
    coverage: float  # fraction of counted response tokens whose id is in the draft vocab

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:  # [V_d] int64, target = i + d2t[i]
        return d2t_from_draft_ids(self.draft_ids)

    def report(self) -> str:
        return (f"draft vocab: {self.size}/{self.vocab_size} tokens ({100 * self.size / self.vocab_size:.1f}%), "
                f"covering {100 * self.coverage:.2f}% of response tokens")


def d2t_from_draft_ids(draft_ids: torch.Tensor) -> torch.Tensor:
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
    return draft_ids - torch.arange(draft_ids.numel(), dtype=torch.long)


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    d2t = torch.as_tensor(d2t, dtype=torch.long)
    return d2t + torch.arange(d2t.numel(), dtype=torch.long)


def count_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """samples: iterable of (input_ids [T], loss_mask [T]) -> counts [V] int64 of tokens with loss_mask = 1."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        ids = torch.as_tensor(ids).long().flatten()
        mask = torch.as_tensor(mask).bool().flatten()
        sel = ids[mask]
        if sel.numel() and (sel.min() < 0 or sel.max() >= vocab_size):
            raise ValueError(f"token id out of range [0, {vocab_size})")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def coverage_of(draft_ids: torch.Tensor, counts: torch.Tensor) -> float:
    total = int(counts.sum())
    return float(counts[draft_ids].sum()) / total if total else 1.0


def build_draft_vocab(counts: torch.Tensor, coverage: float = 0.99, size: int | None = None,
                      always_include: Iterable[int] = (), multiple_of: int = 1) -> DraftVocab:
    """Choose the draft vocabulary from token counts [V].

    size=None: the smallest most-frequent set reaching `coverage` of all counted tokens, plus `always_include`.
    size=N: exactly N tokens: `always_include` first, then the most frequent (ties: lower id first).
    multiple_of: round the size up (more tokens by frequency) to a multiple, for matmul-friendly shapes.
    """
    counts = torch.as_tensor(counts, dtype=torch.long).flatten()
    V = counts.numel()
    forced = sorted({int(t) for t in always_include})
    if any(not 0 <= t < V for t in forced):
        raise ValueError(f"always_include ids must be in [0, {V})")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    # frequency order, ties by id (stable sort of ids by -count)
    order = torch.sort(-counts, stable=True).indices
    total = int(counts.sum())
    if size is None:
        if total == 0:
            n = 0
        else:
            csum = counts[order].cumsum(0)
            need = max(1, math.ceil(coverage * total - 1e-9))  # occurrences to cover (float-safe)
            n = int(torch.searchsorted(csum, torch.tensor([need]))[0]) + 1
        chosen = set(order[:n].tolist()) | set(forced)
        target = len(chosen)
    else:
        if not len(forced) <= size <= V:
            raise ValueError(f"size must be in [{len(forced)} (always_include), {V}], got {size}")
        chosen = set(forced)
        target = size
    if multiple_of > 1:
        target = min(V, -(-target // multiple_of) * multiple_of)
    if len(chosen) < target:
        for t in order.tolist():
            if len(chosen) >= target:
                break
            chosen.add(t)
    draft_ids = torch.tensor(sorted(chosen), dtype=torch.long)
    return DraftVocab(draft_ids=draft_ids, vocab_size=V, coverage=coverage_of(draft_ids, counts))


def full_vocab(vocab_size: int) -> DraftVocab:
    return DraftVocab(draft_ids=torch.arange(vocab_size, dtype=torch.long), vocab_size=vocab_size, coverage=1.0)
