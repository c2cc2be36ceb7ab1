"""Training losses (docs/dspark.md §4-§5).

DSpark: 0.1·CE + 0.9·L1 + 1.0·BCE(conf);  DFlash: 1.0·CE.   Each term is a position-weighted mean
Σ w_k·x / Σ w_k over supervised slots, w_k = exp(-(k-1)/decay) (decay 4.0 as the reference code, or "gamma" = γ as
the paper).  The denominator can be passed in (global Σw summed over data-parallel ranks).

* p_t = softmax(lm_head_full(last_hidden at p+k-1)) at T=1 -- computed by `TargetHead` in VOCABULARY CHUNKS (memory
  [N, chunk]) and only once per distinct sequence position (overlapping blocks share positions).
* With a reduced draft vocabulary p_d lives on V_d (0 elsewhere), so exactly
      ‖p_d - p_t‖₁ = Σ_{v in V_d} |p_d(v) - p_t(v)| + p_t(outside V_d),
  and `TargetHead` returns p_t restricted to V_d plus the outside mass.  distance="tv" halves it.
* CE labels outside the draft vocabulary cannot be predicted: they contribute 0 to the CE numerator (skipped) but
  the slot still counts in the shared denominator and still gets the L1 / confidence terms.
* Soft confidence label c* = clamp(1 - ½·L1, 0, 1), detached; BCE-with-logits on the raw (un-STS'd) logits.
* `SoftmaxL1CE` fuses softmax, CE and L1 with an analytic backward (saves one [N, V_d] tensor instead of ~6).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.dspark.anchors import Blocks
from pipeline.ops.layers import full_vocab_lse


@dataclass
class LossConfig:
    kind: str = "dspark"  # 'dspark' | 'dflash'
    ce_weight: float | None = None  # None -> 0.1 (dspark) / 1.0 (dflash)
    dist_weight: float | None = None  # None -> 0.9 / 0.0
    conf_weight: float | None = None  # None -> 1.0 / 0.0 (0 if the drafter has no confidence head)
    distance: str = "l1"  # 'l1' (reference code) | 'tv' (= l1/2, the paper's wording)
    decay: float | str = 4.0  # position-weight decay; "gamma" -> block_size (paper)
    vocab_chunk: int = 8192  # TargetHead chunk over the full vocabulary

    def __post_init__(self):
        if self.kind not in ("dspark", "dflash"):
            raise ValueError(f"LossConfig.kind must be 'dspark' or 'dflash', got {self.kind!r}")
        if self.distance not in ("l1", "tv"):
            raise ValueError(f"LossConfig.distance must be 'l1' or 'tv', got {self.distance!r}")
        if isinstance(self.decay, str) and self.decay != "gamma":
            raise ValueError(f"LossConfig.decay must be a number or 'gamma', got {self.decay!r}")
        ds = self.kind == "dspark"
        if self.ce_weight is None:
            self.ce_weight = 0.1 if ds else 1.0
        if self.dist_weight is None:
            self.dist_weight = 0.9 if ds else 0.0
        if self.conf_weight is None:
            self.conf_weight = 1.0 if ds else 0.0


def position_weights(block_size: int, decay: float | str = 4.0, device=None) -> torch.Tensor:
    """[γ] fp32: w_k = exp(-(k-1)/decay), k = 1..γ."""
    dec = float(block_size) if decay == "gamma" else float(decay)
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / dec)


def weight_sum(label_mask: torch.Tensor, decay: float | str = 4.0) -> torch.Tensor:
    """Σ w_k over supervised slots of label_mask [..., γ] (all-reduce this across ranks for a global denominator)."""
    w = position_weights(label_mask.shape[-1], decay, label_mask.device)
    return (label_mask.float() * w).sum()


# ---------------------------------------------------------------------------------------------------------------
# target distribution
# ---------------------------------------------------------------------------------------------------------------
class TargetHead(nn.Module):
    """Frozen full target LM head, rows permuted so the draft vocabulary comes first.

    draft_probs(hidden [N,d]) -> (p_t on V_d [N,V_d] fp32, p_t mass outside V_d [N] fp32), exact softmax at T=1,
    never materialising more than [N, vocab_chunk] full-vocabulary logits.
    """

    def __init__(self, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor, vocab_chunk: int = 8192):
        super().__init__()
        V = lm_head_weight.shape[0]
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long, device=lm_head_weight.device)
        rest = torch.ones(V, dtype=torch.bool, device=lm_head_weight.device)
        rest[draft_ids] = False
        perm = torch.cat([draft_ids, rest.nonzero().flatten()])
        self.register_buffer("weight", lm_head_weight.detach().float()[perm].contiguous(), persistent=False)
        self.Vd = int(draft_ids.numel())
        self.vocab_chunk = int(vocab_chunk)

    def _out_lse(self, h: torch.Tensor) -> torch.Tensor:
        """logsumexp over the non-draft rows, chunked.  h [N,d] fp32 -> [N] (-inf if V_d = V)."""
        return full_vocab_lse(h, self.weight[self.Vd:], chunk=self.vocab_chunk)

    @torch.no_grad()
    def stats(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., d] -> (lse over the full vocab [...], mass outside V_d [...]); cacheable per position."""
        h = hidden.reshape(-1, hidden.shape[-1]).float()
        out = []
        for r0 in range(0, h.shape[0], 2048):  # rows per pass: bounds the [rows, V_d] logits
            hr = h[r0:r0 + 2048]
            lse_d = torch.logsumexp(hr @ self.weight[:self.Vd].T, dim=-1)
            lse_o = self._out_lse(hr)
            lse = torch.logaddexp(lse_d, lse_o)
            out.append((lse, torch.exp(lse_o - lse)))
        lse = torch.cat([o[0] for o in out]).view(hidden.shape[:-1])
        mo = torch.cat([o[1] for o in out]).view(hidden.shape[:-1])
        return lse, mo

    @torch.no_grad()
    def draft_probs(self, hidden: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor | None] | None = None):
        """hidden [N,d] -> (pt_d [N,V_d] fp32, mass_out [N] fp32).  `stats` = precomputed (lse, mass_out) [N];
        mass_out None -> 1 - Σ pt_d (the full-vocabulary lse is all that a store needs to keep).

        On a CPU the teacher stays fp32 under bf16 autocast: casting the whole [V, d] head to bf16 at every call costs
        more than the bf16 GEMM saves, and those copies can take a large share of a bf16 training step."""
        if hidden.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return self.draft_probs(hidden, stats)
        h = hidden.float()
        logits_d = h @ self.weight[:self.Vd].T  # [N, V_d]
        if stats is None:
            lse_o = self._out_lse(h)
            lse = torch.logaddexp(torch.logsumexp(logits_d, dim=-1), lse_o)
            mass_out = torch.exp(lse_o - lse)
        else:
            lse = stats[0].float()
            mass_out = None if stats[1] is None else stats[1].float()
        pt = logits_d.sub_(lse[:, None]).exp_()
        if mass_out is None:
            mass_out = (1.0 - pt.sum(-1)).clamp_(min=0.0)
        return pt, mass_out

    @torch.no_grad()
    def full_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unchunked reference (tests): softmax over the full vocabulary, in TARGET id order [N, V]."""
        return torch.softmax(hidden.float() @ self.weight.T, dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# fused softmax + CE + L1
# ---------------------------------------------------------------------------------------------------------------
class SoftmaxL1CE(torch.autograd.Function):
    """(g [N,V_d], pt [N,V_d], mass_out [N], label [N] (-1 = none)) -> (l1 [N], ce [N]), p_d = softmax(g).

    l1 = Σ|p_d - pt| + mass_out;  ce = -log p_d[label] (0 where label < 0).
    d l1/d g = p_d ⊙ (s - <p_d, s>), s = sign(p_d - pt);   d ce/d g = p_d - onehot(label).
    """

    @staticmethod
    def forward(ctx, g, pt, mass_out, label):
        gf = g if g.dtype == torch.float64 else g.float()
        gmax = gf.max(-1, keepdim=True).values
        p = (gf - gmax).exp_()
        Z = p.sum(-1, keepdim=True)
        p.div_(Z)
        logZ = (gmax + Z.log()).squeeze(-1)
        has = label >= 0
        lab = label.clamp_min(0)
        ce = torch.where(has, logZ - gf.gather(-1, lab[:, None]).squeeze(-1), torch.zeros_like(logZ))
        l1 = torch.sub(p, pt).abs_().sum(-1) + mass_out
        ctx.save_for_backward(p, pt, lab, has)
        ctx.g_dtype = g.dtype
        return l1, ce

    @staticmethod
    def backward(ctx, g_l1, g_ce):
        p, pt, lab, has = ctx.saved_tensors
        grad = torch.sub(p, pt).sign_()  # s
        if g_l1 is not None:
            ps = torch.bmm(p[:, None, :], grad[:, :, None]).view(-1, 1)  # <p, s>
            grad.sub_(ps).mul_(p).mul_(g_l1[:, None])
        else:
            grad.zero_()
        if g_ce is not None:
            gce = torch.where(has, g_ce, torch.zeros_like(g_ce))
            grad.addcmul_(p, gce[:, None])
            grad.scatter_add_(-1, lab[:, None], -gce[:, None])
        return grad.to(ctx.g_dtype), None, None, None


# ---------------------------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    parts: dict  # name -> detached weighted mean (ce, dist, conf)
    metrics: dict = field(default_factory=dict)  # floats / lists for logging
    weight_sum: float = 0.0  # local Σw (the denominator used when none was passed)
    num_supervised: int = 0


def loss_from_logits(logits: torch.Tensor, conf_logits: torch.Tensor | None, label_d: torch.Tensor,
                     slot: torch.Tensor, block_size: int, cfg: LossConfig, pt_d: torch.Tensor | None = None,
                     mass_out: torch.Tensor | None = None, denom: float | torch.Tensor | None = None) -> LossOutput:
    """logits [N,V_d] Markov-corrected draft logits, conf_logits [N] raw, label_d [N] draft-vocab label (-1 = outside
    the draft vocab), slot [N] 0-based position k-1, pt_d/mass_out from TargetHead (needed unless DFlash-only CE)."""
    N = logits.shape[0]
    w = position_weights(block_size, cfg.decay, logits.device)[slot]  # [N]
    wsum = w.sum()
    den = wsum if denom is None else torch.as_tensor(denom, dtype=torch.float32, device=logits.device)
    den = den.clamp_min(1e-12)
    need_target = cfg.dist_weight > 0 or (cfg.conf_weight > 0 and conf_logits is not None)
    parts, metrics = {}, {}
    if need_target:
        if pt_d is None or mass_out is None:
            raise ValueError("this loss needs the target distribution (pt_d, mass_out)")
        l1, ce = SoftmaxL1CE.apply(logits, pt_d, mass_out, label_d)
    else:
        ce = F.cross_entropy(logits.float(), label_d.clamp_min(0), reduction="none") * (label_d >= 0)
        l1 = None
    total = cfg.ce_weight * (w * ce).sum() / den
    parts["ce"] = ((w * ce).sum() / den).detach()
    if l1 is not None:
        dist = l1 if cfg.distance == "l1" else 0.5 * l1
        parts["dist"] = ((w * dist).sum() / den).detach()
        if cfg.dist_weight:
            total = total + cfg.dist_weight * (w * dist).sum() / den
    if conf_logits is not None and l1 is not None:
        target = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # soft label c*
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), target, reduction="none")
        parts["conf"] = ((w * bce).sum() / den).detach()
        if cfg.conf_weight:
            total = total + cfg.conf_weight * (w * bce).sum() / den
        metrics["soft_label_mean"] = float(target.mean()) if N else float("nan")
    with torch.no_grad():
        correct = (logits.argmax(-1) == label_d).float()
        cnt = torch.bincount(slot, minlength=block_size).clamp_min(1).float()
        metrics["acc_per_pos"] = (torch.zeros(block_size, device=logits.device)
                                  .index_add_(0, slot, correct) / cnt).tolist()
        metrics["label_in_vocab"] = float((label_d >= 0).float().mean()) if N else float("nan")
    return LossOutput(loss=total, parts=parts, metrics=metrics, weight_sum=float(wsum), num_supervised=N)


def drafter_loss(drafter, target_head: TargetHead | None, aux_hidden: torch.Tensor, input_ids: torch.Tensor,
                 last_hidden: torch.Tensor | None, blocks: Blocks, cfg: LossConfig,
                 denom: float | torch.Tensor | None = None,
                 target_stats: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> LossOutput:
    """Full training loss for one batch.

    aux_hidden [B,T,n·d], input_ids [B,T], last_hidden [B,T,d] (target final hidden, after its norm), blocks from
    `pipeline.dspark.anchors.make_blocks`.  target_stats: optional cached (lse [B,T], mass_out [B,T] or None) from
    `TargetHead.stats(last_hidden)` or the store's ``target_lse`` (saves the full-vocabulary pass).
    """
    G = drafter.cfg.block_size
    B, T = input_ids.shape
    rows = blocks.label_mask  # [B,S,γ]
    h = drafter.forward_train(aux_hidden, input_ids, blocks.anchors, blocks.valid)  # [B,S,γ,d]
    out = drafter.block_logits(h, blocks.prev, rows)
    slot = torch.arange(G, device=rows.device).expand_as(rows)[rows]  # [N] k-1
    label_d = drafter.t2d[blocks.labels[rows]]
    pt_d = mass_out = None
    need_target = cfg.dist_weight > 0 or (cfg.conf_weight > 0 and out.conf_logits is not None)
    if need_target:
        if target_head is None or last_hidden is None:
            raise ValueError("drafter_loss: DSpark losses need target_head and last_hidden")
        tpos = (blocks.anchors[:, :, None] + torch.arange(G, device=rows.device))  # p+k-1
        flat = (torch.arange(B, device=rows.device)[:, None, None] * T + tpos)[rows]
        uniq, inv = torch.unique(flat, return_inverse=True)  # each sequence position once
        hid = last_hidden.reshape(B * T, -1)[uniq]
        st = None if target_stats is None else (
            target_stats[0].reshape(-1)[uniq], None if target_stats[1] is None else target_stats[1].reshape(-1)[uniq])
        pt_u, mo_u = target_head.draft_probs(hid, st)
        pt_d, mass_out = pt_u[inv], mo_u[inv]
    return loss_from_logits(out.logits, out.conf_logits, label_d, slot, G, cfg, pt_d, mass_out, denom)
