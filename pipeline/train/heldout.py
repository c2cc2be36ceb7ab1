"""The held-out measurements of a drafter in the middle of training: teacher-forced and greedy-walk acceptance length.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from pipeline.dspark.anchors import anchor_candidates, block_labels
from pipeline.ops.packed_linear import forget_packed


@contextmanager
def evaluating(model):
    """Measure a drafter in the middle of training: eval mode, its packed weight copies dropped (the fused AdamW steps
    since the last measurement did not bump the weights' version counters), its training mode restored after."""
    was_training = model.training
    model.eval()
    forget_packed(model)
    try:
        yield model
    finally:
        model.train(was_training)


def on_model_device(model):
    """sample -> the same sample with its tensors on the model's device (held-out samples come from a store on the
    CPU; a no-op there)."""
    device = model.fc.weight.device

    def move(sample: dict) -> dict:
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}

    return move


@torch.no_grad()
def teacher_forced_tau(model, samples: list[dict], blocks_per_sample: int = 64) -> dict:
    """Greedy acceptance length of the drafter on held-out sequences, teacher-forced and full depth.

    For evenly spaced anchors p whose γ labels are all supervised, the drafter's block is computed with the TRUE
    predecessors (training path); a draft token counts while argmax g_k == token[p+k] for every slot so far.  While
    that prefix holds, the true predecessors ARE the drafted ones, so the count equals what greedy drafting would get
    verified against this sequence; tau = 1 + mean accepted (the +1 is the target's bonus token).  On responses the
    target generated greedily (jobs.generate's default) that is the greedy verification tau at depth γ.
    -> dict(tau, blocks, accept_hist [γ+1]: fraction of blocks accepting exactly j drafts)."""
    G = model.cfg.block_size
    hist = torch.zeros(G + 1)
    with evaluating(model):
        for s in map(on_model_device(model), samples):
            ids, mask = s["input_ids"].long()[None], s["loss_mask"][None]
            cand = anchor_candidates(mask)[0].nonzero().squeeze(1)  # [C]
            blk = block_labels(ids, mask, cand[None], torch.ones(1, len(cand), dtype=torch.bool, device=ids.device), G)
            keep = blk.label_mask[0].all(-1).nonzero().squeeze(1)  # blocks with γ supervised labels
            if len(keep) == 0:
                continue
            if len(keep) > blocks_per_sample:
                keep = keep[torch.linspace(0, len(keep) - 1, blocks_per_sample, device=keep.device).round().long()]
            h = model.forward_train(s["aux_hidden"][None], ids, cand[keep][None])  # [1,S,γ,d]
            logits = model.block_logits(h, blk.prev[:, keep]).logits  # [S·γ, V_d]
            pred = model.draft_ids[logits.argmax(-1)].view(-1, G)  # target ids
            accepted = (pred == blk.labels[0, keep]).long().cumprod(-1).sum(-1)  # [S]
            hist += torch.bincount(accepted, minlength=G + 1).float().cpu()
    n = float(hist.sum())
    tau = float(1.0 + (hist * torch.arange(G + 1)).sum() / n) if n else float("nan")
    return dict(tau=tau, blocks=int(n), accept_hist=(hist / max(n, 1.0)).tolist())


@torch.no_grad()
def greedy_walk_tau(model, samples: list[dict], max_tokens: int) -> dict:
    """tau of greedy speculative decoding replayed along the stored responses (they ARE the target's greedy output),
    counted the way the engine counts it: the first response token comes from the prefill; each round drafts γ
    tokens from the last emitted one, keeps the matching prefix (a) plus the target's bonus token and moves a + 1
    tokens on, until max_tokens are emitted.  tau = tokens emitted by rounds / rounds, so (unlike the
    position-averaged teacher-forced tau) easy stretches count once per round, as in a rollout."""
    G = model.cfg.block_size
    emitted = rounds = 0
    with evaluating(model):
        for s in map(on_model_device(model), samples):
            ids, mask = s["input_ids"].long()[None], s["loss_mask"][None]
            resp = mask[0].nonzero().squeeze(1)
            if len(resp) < 2:
                continue
            start, end = int(resp[0]), min(int(resp[-1]) + 1, int(resp[0]) + max_tokens)  # response span to replay
            anchors = torch.arange(start, end - 1, device=ids.device)[None]  # a round can start at any of them
            blk = block_labels(ids, mask, anchors, torch.ones_like(anchors, dtype=torch.bool), G)
            h = model.forward_train(s["aux_hidden"][None], ids, anchors)
            pred = model.draft_ids[model.block_logits(h, blk.prev).logits.argmax(-1)].view(-1, G)
            ok = (pred == blk.labels[0]) & blk.label_mask[0].bool()
            accepted = ok.long().cumprod(-1).sum(-1).tolist()  # [S] drafts accepted from anchor start + i
            q = start  # last emitted token (the prefill emitted `start`)
            while q < end - 1:
                step = min(accepted[q - start] + 1, end - 1 - q)  # accepted drafts + bonus, cut at max_tokens
                emitted += step
                rounds += 1
                q += step
    return dict(tau=emitted / rounds if rounds else float("nan"), rounds=rounds, tokens=emitted)
