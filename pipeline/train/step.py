"""One optimizer step's forward and backward: batches of store samples, the anchors and block labels of a step (drawn
from (seed, rank, step), so a resumed run draws the same), and the gradient accumulation over micro-batches.
"""
from __future__ import annotations

import zlib

import torch

from pipeline.dspark.anchors import Blocks, make_blocks
from pipeline.dspark.losses import drafter_loss, weight_sum


def collate(samples: list[dict], blocks: list, need_target: bool, device=None) -> dict:
    """Right-pad store samples (and their per-sample Blocks) into one batch.  Padding is never read: a block at
    anchor p attends to context positions < p only, and labels / target statistics are gathered at supervised
    positions only.  -> dict(aux [B,T,n·d], ids [B,T], last [B,T,d] | None, lse [B,T] | None, blocks [B,S,γ])."""
    T = max(int(s["input_ids"].shape[0]) for s in samples)

    def pad(t):  # [T_i, ...] -> [T, ...]
        n = t.shape[0]
        return t if n == T else torch.cat([t, t.new_zeros((T - n,) + tuple(t.shape[1:]))])

    def stack(key, conv=lambda t: t):
        return torch.stack([pad(conv(s[key])) for s in samples]).to(device)

    has_lse = need_target and all(s.get("target_lse") is not None for s in samples)
    blk = Blocks(**{f: torch.cat([getattr(b, f) for b in blocks]).to(device)
                    for f in ("anchors", "valid", "labels", "prev", "label_mask")})
    return dict(aux=stack("aux_hidden"), ids=stack("input_ids", lambda t: t.long()),
                last=stack("last_hidden") if need_target else None,
                lse=stack("target_lse") if has_lse else None, blocks=blk)


def step_seed(seed: int, rank: int, step: int, purpose: str = "") -> int:
    """The seed of one rank's random draws at `step` (anchors: purpose ""; feature noise: "noise:"), so a resumed
    run draws what the uninterrupted one would have."""
    return zlib.crc32(f"{purpose}{seed}:{rank}:{step}".encode())


def step_blocks(samples: list[dict], num_anchors: int, block_size: int, decay, seed: int, rank: int, step: int):
    """This rank's anchors and block labels for `step`, drawn from (seed, rank, step) so a resumed run draws the same,
    and their local weight sum Σw (all-reduce it across ranks for the step's global denominator)."""
    gen = torch.Generator().manual_seed(step_seed(seed, rank, step))
    blocks = [make_blocks(s["input_ids"].long(), s["loss_mask"], num_anchors, block_size, gen) for s in samples]
    return blocks, sum(float(weight_sum(b.label_mask, decay)) for b in blocks)


def noisy_features(aux: torch.Tensor, hidden_size: int, rel_std: float, gen: torch.Generator) -> torch.Tensor:
    """One sequence's injected features aux [T, n·d] plus Gaussian noise of std rel_std · the RMS of each token's
    d-slice per layer (the n injected layers have different scales).  Drawn on the CPU from `gen`."""
    T, nd = aux.shape
    x = aux.float().view(T, nd // hidden_size, hidden_size)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [T,n,1]
    noise = torch.randn(x.shape, generator=gen).to(x.device)
    return (x + rel_std * rms * noise).view(T, nd).to(aux.dtype)


def micro_batch_count(blocks: list, micro_batch: int) -> int:
    """How many forward/backward passes accumulate_gradients runs for these blocks: one per `micro_batch`
    sequences that have a supervised block."""
    return -(-sum(b.num_supervised > 0 for b in blocks) // max(1, micro_batch))


def accumulate_gradients(model, target_head, samples: list[dict], blocks: list, loss_cfg, denom: float,
                         micro_batch: int = 1, bf16: bool = False, device=None, feature_noise: float = 0.0,
                         noise_seed: int = 0, min_chunks: int = 0):
    """Forward + backward of one optimizer step's sequences, `micro_batch` at a time (longest first, so padding
    stays small), every loss divided by the step's GLOBAL weight sum `denom`: the accumulated gradient is the
    same for any micro_batch.  feature_noise > 0: the injected features get noise (`noisy_features`) drawn from
    `noise_seed`, so a resumed run draws the same.  min_chunks: run at least that many forward/backward passes,
    the extra ones repeating the last micro-batch with weight 0 (a sharded model's passes are collectives: every
    rank runs as many).  -> (loss parts summed, supervised positions, per-position accuracy · count)."""
    need_target = target_head is not None
    todo = [(s, b) for s, b in zip(samples, blocks) if b.num_supervised > 0]
    todo.sort(key=lambda sb: -int(sb[0]["input_ids"].shape[0]))
    dev = torch.device(device) if device is not None else model.fc.weight.device
    parts, n_sup = {"loss": 0.0}, 0
    acc = torch.zeros(model.cfg.block_size)
    if feature_noise > 0:  # per sequence, in the sorted order: the same noise for any micro_batch
        gen = torch.Generator().manual_seed(noise_seed)
        todo = [(s | {"aux_hidden": noisy_features(s["aux_hidden"], model.cfg.hidden_size, feature_noise, gen)}, b)
                for s, b in todo]
    starts = list(range(0, len(todo), max(1, micro_batch)))
    real = len(starts)  # == micro_batch_count(blocks, micro_batch)
    if real < min_chunks:
        if not starts:
            raise RuntimeError("accumulate_gradients: no sequence of this rank has a supervised block, so it cannot "
                               f"take part in the {min_chunks} sharded forward/backward passes of this step")
        starts += [starts[-1]] * (min_chunks - real)
    for j, i in enumerate(starts):
        chunk = todo[i:i + max(1, micro_batch)]
        x = collate([s for s, _ in chunk], [b for _, b in chunk], need_target, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            out = drafter_loss(model, target_head, x["aux"], x["ids"], x["last"], x["blocks"], loss_cfg,
                               denom=denom, target_stats=None if x["lse"] is None else (x["lse"], None))
        if j >= real:  # a padding pass: gradients += 0
            (out.loss * 0.0).backward()
            continue
        out.loss.backward()
        parts["loss"] += float(out.loss.detach())
        for k, v in out.parts.items():
            parts[k] = parts.get(k, 0.0) + float(v)
        n_sup += out.num_supervised
        acc += torch.tensor(out.metrics["acc_per_pos"]) * out.num_supervised
    return parts, n_sup, acc
