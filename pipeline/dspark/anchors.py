"""Anchor sampling and block labels for teacher-forced training (docs/dspark.md §5).

* candidate anchor: position p with loss_mask[p] = loss_mask[p+1] = 1 (p+1 inside the sequence);
* up to `num_anchors` per sequence, uniformly without replacement, redrawn on every visit (pass a torch.Generator),
  sorted ascending; missing slots are dummy blocks (valid=False, position 0) that the model and loss ignore;
* block labels x*_k = token[p+k], k = 1..γ; predecessors prev_k = token[p+k-1] (prev_1 = the anchor);
* slot k is supervised while p+k is inside the sequence and loss_mask[p+k] = 1, stopping at the first failure
  (so supervision is always a prefix of the block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Blocks:
    anchors: torch.Tensor  # [B,S] int64 anchor positions p (0 for dummies), valid ones sorted ascending
    valid: torch.Tensor  # [B,S] bool, False = dummy block
    labels: torch.Tensor  # [B,S,γ] int64 x*_k = token[p+k] (0 where outside the sequence)
    prev: torch.Tensor  # [B,S,γ] int64 token[p+k-1]: the Markov / confidence predecessor of slot k
    label_mask: torch.Tensor  # [B,S,γ] bool, supervised slots (a prefix of each valid block)

    @property
    def num_supervised(self) -> int:
        return int(self.label_mask.sum())


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [B,T] -> [B,T] bool: loss_mask[p] & loss_mask[p+1] (False at the last position)."""
    m = loss_mask.bool()
    cand = torch.zeros_like(m)
    cand[:, :-1] = m[:, :-1] & m[:, 1:]
    return cand


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """loss_mask [B,T] (or [T]) -> (anchors [B,S], valid [B,S]) with S = num_anchors.

    Uniform without replacement among the candidates (random keys + top-k, no Python loop), sorted ascending,
    dummies (valid=False, anchor 0) at the end.
    """
    if loss_mask.dim() == 1:
        loss_mask = loss_mask[None]
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    B, T = loss_mask.shape
    cand = anchor_candidates(loss_mask)
    keys = torch.rand(B, T, generator=generator, device=loss_mask.device if generator is None else generator.device)
    keys = keys.to(loss_mask.device).masked_fill(~cand, 2.0)  # non-candidates sort last
    S = num_anchors
    k = min(S, T)
    chosen_keys, chosen = torch.topk(keys, k, dim=1, largest=False)  # [B,k]
    valid = chosen_keys < 1.5
    pos = torch.where(valid, chosen, torch.full_like(chosen, T))  # dummies sort after every real position
    pos, _ = pos.sort(dim=1)
    valid = pos < T
    pos = pos.masked_fill(~valid, 0)
    if k < S:
        pad = S - k
        pos = torch.cat([pos, pos.new_zeros(B, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(B, pad)], 1)
    return pos, valid


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int) -> Blocks:
    """Labels, predecessors and supervision mask for each block.  input_ids/loss_mask [B,T], anchors/valid [B,S]."""
    if input_ids.dim() == 1:
        input_ids, loss_mask = input_ids[None], loss_mask[None]
    B, T = input_ids.shape
    G = block_size
    anchors = anchors.long()
    k = torch.arange(1, G + 1, device=anchors.device)
    pos = anchors[:, :, None] + k  # [B,S,γ] label positions p+k
    inside = pos < T
    posc = pos.clamp_max(T - 1).reshape(B, -1)
    labels = input_ids.long().gather(1, posc).view_as(pos).masked_fill(~inside, 0)
    prev = input_ids.long().gather(1, (pos - 1).clamp_max(T - 1).reshape(B, -1)).view_as(pos)
    ok = inside & loss_mask.bool().gather(1, posc).view_as(pos) & valid.bool()[:, :, None]
    label_mask = ok.long().cumprod(-1).bool()  # stop at the first failure
    return Blocks(anchors=anchors, valid=valid.bool(), labels=labels, prev=prev, label_mask=label_mask)


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int, block_size: int,
                generator: torch.Generator | None = None) -> Blocks:
    """sample_anchors + block_labels."""
    if input_ids.dim() == 1:
        input_ids, loss_mask = input_ids[None], loss_mask[None]
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    return block_labels(input_ids, loss_mask, anchors, valid, block_size)
