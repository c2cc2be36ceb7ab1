"""Fixed-shape forwards for CUDA graphs: the target's verification forward and the DSpark drafting round, each padded
to a bucket of (rows, tokens, keys) and, on a GPU, recorded once per bucket in a CUDA graph and replayed after.

Padding never changes a real row's result (only the rounding of reductions over masked keys):

* target (StaticTargetForward): R requests with n_r <= T new tokens become an [R_b, T_b] token grid.  Real tokens
  write their K/V at (slot, position) as the eager forward does; padding tokens (and whole padding rows) write theirs
  into a reserved pad slot of the KV cache that no request owns.  Queries attend the first K_b cached keys of their
  row's slot with the exact causal / sliding-window mask (keys past a request's length are masked), padding queries
  reuse the row's last real position (pad rows: position 0 of the pad slot) so no row is fully masked.  Logits and aux
  hidden states are computed for the whole grid and the real rows are gathered afterwards.
* drafter (StaticDraftProposer): B requests become B_b rows and every context window is copied into a static
  [layers, 2, B_b, K, L_b, h] buffer with a length mask; padding rows see no context (only their own block).  The
  backbone, the LM head and, for greedy drafting, the Markov loop run in the graph; sampling (CPU generators) and
  the confidence head run eagerly on the graph's outputs.

The static KV cache is the runner's own preallocated [layers, slots, max_len, kv_heads, head_dim] tensor; graphs hold
its address, so they are dropped and re-recorded when the cache (or the RoPE table) is reallocated.  Without
``capture`` the same padded computation runs eagerly: that is how the CPU tests check it against the ragged path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from pipeline.dspark.calibration import apply_sts
from pipeline.dspark.drafter import DraftProposal, DraftState, DSparkDrafter
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.target_runner import RaggedBatch, TargetOutput, TargetRunner, attention_mask

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class StaticShapes:
    """The padded shapes fixed-shape forwards are built for.  A batch is padded to the smallest bucket that holds it;
    a batch larger than every bucket runs eagerly."""

    row_buckets: tuple = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # requests per forward / drafting round
    max_tokens: int = 8  # new tokens per request of a target bucket (verification: depth + 1)
    token_buckets: tuple | None = None  # None: every count 1..max_tokens (no token padding in uniform batches)
    min_keys: int = 64  # key / context lengths are padded to powers of two from this

    def __post_init__(self):
        if not self.row_buckets or min(self.row_buckets) < 1:
            raise ValueError(f"row_buckets must be positive, got {self.row_buckets}")
        if self.max_tokens < 1 or self.min_keys < 1:
            raise ValueError("max_tokens and min_keys must be >= 1")
        if self.token_buckets is not None and (not self.token_buckets or min(self.token_buckets) < 1):
            raise ValueError(f"token_buckets must be positive, got {self.token_buckets}")
        self.row_buckets = tuple(sorted(set(self.row_buckets)))
        self.token_buckets = tuple(sorted(set(self.token_buckets or range(1, self.max_tokens + 1))))

    def rows(self, n: int) -> int | None:
        return next((b for b in self.row_buckets if b >= n), None)

    def tokens(self, n: int) -> int | None:
        return next((b for b in self.token_buckets if b >= n), None)

    def keys(self, n: int, cap: int | None = None) -> int:
        b = self.min_keys
        while b < n:
            b *= 2
        return b if cap is None else max(n, min(b, cap))


def _record(body, pool):
    """Warm ``body`` up on a side stream, then record it in a CUDA graph -> (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


class _Entry:
    """One bucket: its static input buffer, its outputs and (when recorded) its graph."""

    __slots__ = ("inputs", "outputs", "graph", "extra")

    def __init__(self, inputs: torch.Tensor, extra=None):
        self.inputs, self.outputs, self.graph, self.extra = inputs, None, None, extra


class StaticTargetForward:
    """TargetRunner.forward for batches of at most ``max(row_buckets)`` requests with at most ``max_tokens`` new
    tokens each, padded to (rows, tokens, keys) buckets (module docstring).  Attached as ``runner.static_forward``."""

    def __init__(self, runner: TargetRunner, shapes: StaticShapes, capture: bool):
        if capture and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        self.runner, self.shapes, self.capture = runner, shapes, capture
        self.pad_slot = runner.alloc()  # never freed: padding tokens write their K/V here
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.entries: dict = {}
        self._bound = None  # (k_cache, v_cache, cos) the recorded graphs read
        self.runs = 0  # padded forwards
        self.recorded = 0  # graphs recorded (re-recordings after a cache reallocation included)
        self.replays = 0

    def fits(self, batch: RaggedBatch) -> bool:
        return (self.shapes.rows(batch.num_requests) is not None and self.shapes.tokens(batch.max_new) is not None
                and self.pad_slot not in batch.slots)

    def __call__(self, batch: RaggedBatch, aux_ids: list) -> TargetOutput:
        r = self.runner
        self.runs += 1
        R, Rb = batch.num_requests, self.shapes.rows(batch.num_requests)
        Tb = self.shapes.tokens(batch.max_new)
        Kb = self.shapes.keys(batch.key_len, r._cap)
        cos_t, sin_t = r._rope(Kb)
        bound = (r.k_cache, r.v_cache, cos_t)
        if self._bound is None or any(a is not b for a, b in zip(bound, self._bound)):
            self.entries.clear()  # the graphs read the old cache / RoPE table
            self._bound = bound
        # host layout: the [R_b, T_b] grid's token ids, positions, cache slots and query positions, each row's slot;
        # then where the real tokens and the logits rows sit in the grid
        ids, pos, tslot, qpos, rslot, grid = [], [], [], [], [], []
        pad = self.pad_slot
        for row in range(Rb):
            if row < R:
                n, st, s = batch.num_new[row], batch.starts[row], batch.slots[row]
                a = batch.token_offsets[row]
                ids.extend(batch.token_ids[a:a + n])
                ids.extend([0] * (Tb - n))
                pos.extend(range(st, st + n))
                pos.extend(range(n, Tb))  # padding tokens: pad slot positions n..T_b-1
                tslot.extend([s] * n)
                tslot.extend([pad] * (Tb - n))
                qpos.extend(st + min(t, n - 1) for t in range(Tb))
                rslot.append(s)
                grid.extend(range(row * Tb, row * Tb + n))
            else:
                ids.extend([0] * Tb)
                pos.extend(range(Tb))
                tslot.extend([pad] * Tb)
                qpos.extend([0] * Tb)
                rslot.append(pad)
        rows = [grid[j] for j in batch.logit_rows]  # [M] grid row of each logits row
        n_static = 4 * Rb * Tb + Rb
        host = torch.tensor(ids + pos + tslot + qpos + rslot + grid + rows, dtype=torch.long)
        dev_all = host.to(r.device, non_blocking=True)
        key = (Rb, Tb, Kb, tuple(aux_ids))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(torch.zeros(n_static, dtype=torch.long, device=r.device))
            entry.inputs.copy_(dev_all[:n_static])
            body = lambda: self._body(entry.inputs, Rb, Tb, Kb, aux_ids, cos_t, sin_t)  # noqa: E731
            if self.capture:
                entry.graph, entry.outputs = _record(body, self.pool)
                self.recorded += 1
        else:
            entry.inputs.copy_(dev_all[:n_static])
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        else:
            entry.outputs = self._body(entry.inputs, Rb, Tb, Kb, aux_ids, cos_t, sin_t)
        logits_grid, aux_grid = entry.outputs  # [R_b * T_b, V] fp32, [R_b * T_b, n_aux * d] | None
        grid_t = dev_all[n_static:n_static + batch.num_tokens]
        rows_t = dev_all[n_static + batch.num_tokens:]
        logits = logits_grid[rows_t]  # gathers copy out of the static outputs (the next replay overwrites them)
        aux = aux_grid[grid_t] if aux_grid is not None else None
        return TargetOutput(logits=logits, logit_offsets=batch.logit_offsets, aux_hidden=aux,
                            token_offsets=batch.token_offsets)

    def _body(self, inputs: torch.Tensor, Rb: int, Tb: int, Kb: int, aux_ids: Sequence[int], cos_t, sin_t):
        """The layers on the static [R_b * T_b] token grid -> (logits [R_b * T_b, V] fp32, aux | None)."""
        r = self.runner
        c = r.config
        H, KVH, hd = c.num_heads, c.num_kv_heads, c.head_dim
        NT = Rb * Tb
        ids, pos, tslot = inputs[:NT], inputs[NT:2 * NT], inputs[2 * NT:3 * NT]
        qpos = inputs[3 * NT:4 * NT].view(Rb, Tb)
        rslot = inputs[4 * NT:]
        kidx = torch.arange(Kb, device=inputs.device)
        masks = {w: attention_mask(kidx, qpos, w).unsqueeze(1) for w in {r._layer_window(ly, Kb) for ly in r.layers}}
        x, cos, sin, aux_out = r._embed_tokens(ids, pos, cos_t, sin_t, aux_ids)  # x [NT, d], cos / sin [NT, 1, hd]
        gqa = H != KVH
        for li, ly in enumerate(r.layers):
            q, k, v = r._qkv(ly, x, cos, sin)
            kc, vc = r.k_cache[li], r.v_cache[li]
            kc[tslot, pos] = k
            vc[tslot, pos] = v
            K = kc[rslot, :Kb]  # [R_b, K_b, KVH, hd]
            V = vc[rslot, :Kb]
            att = F.scaled_dot_product_attention(q.view(Rb, Tb, H, hd).transpose(1, 2), K.transpose(1, 2),
                                                 V.transpose(1, 2), attn_mask=masks[r._layer_window(ly, Kb)],
                                                 scale=r._scale, enable_gqa=gqa)
            x = r._mlp_block(ly, x, att.transpose(1, 2).reshape(NT, H * hd))
            if (li + 1) in aux_ids:
                aux_out[li + 1] = x
        logits = r._logits(x)
        aux = torch.cat([aux_out[a] for a in aux_ids], -1) if aux_ids else None
        return logits, aux


class StaticDraftProposer:
    """DSparkDrafter.propose with the backbone (and the greedy Markov loop) on fixed (rows, context) buckets
    (module docstring).  Same contract as ``propose``; rounds larger than every row bucket run the drafter's own
    propose."""

    def __init__(self, drafter: DSparkDrafter, shapes: StaticShapes, capture: bool):
        dev = drafter.fc.weight.device
        if capture and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the drafter is on {dev}")
        self.drafter, self.shapes, self.capture = drafter, shapes, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.entries: dict = {}
        self.runs = 0  # padded drafting rounds
        self.recorded = 0
        self.replays = 0

    def __call__(self, states: Sequence[DraftState], anchors: torch.Tensor,
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
                 forced_tokens: torch.Tensor | None = None) -> DraftProposal:
        d = self.drafter
        cfg = d.cfg
        B = len(states)
        Bb = self.shapes.rows(B)
        if Bb is None or forced_tokens is not None:
            return d.propose(states, anchors, params, generator, forced_tokens)
        self.runs += 1
        dev = d.fc.weight.device
        W = cfg.context_window
        lo = [max(st.start, st.length - W) if W is not None else st.start for st in states]
        lens = [st.length - a for st, a in zip(states, lo)]
        Lb = self.shapes.keys(max(lens))
        greedy = params.greedy if isinstance(params, SamplingParams) else all(p.greedy for p in params)
        key = (Bb, Lb, greedy)
        entry = self.entries.get(key)
        new = entry is None
        if new:
            c = cfg
            kv = torch.zeros(c.num_hidden_layers, 2, Bb, c.num_key_value_heads, Lb, c.head_dim,
                             dtype=d.fc.weight.dtype, device=dev)
            entry = self.entries[key] = _Entry(torch.zeros(3 * Bb, dtype=torch.long, device=dev), extra=kv)
        kv = entry.extra
        for b, (st, a, n) in enumerate(zip(states, lo, lens)):  # the context windows into the static buffer
            o = a - st.start
            kv[:, :, b, :, :n] = st.kv[..., o:o + n, :]
        anchors = torch.as_tensor(anchors, dtype=torch.long).view(B).tolist()
        host = torch.tensor(anchors + [0] * (Bb - B) + [st.length for st in states] + [0] * (Bb - B) +
                            lens + [0] * (Bb - B), dtype=torch.long)
        entry.inputs.copy_(host.to(dev, non_blocking=True))
        if new and self.capture:
            entry.graph, entry.outputs = _record(lambda: self._body(entry.inputs, kv, Bb, Lb, greedy), self.pool)
            self.recorded += 1
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        else:
            entry.outputs = self._body(entry.inputs, kv, Bb, Lb, greedy)
        h, U, loop = entry.outputs
        h, U = h[:B].clone(), U[:B].clone()
        if greedy:
            prev_all, toks, idxs, qs, gs = (t[:B].clone() for t in loop)
        else:
            prev_all, toks, idxs, qs, gs = d._sequential_loop(entry.inputs[:B].clone(), h, U, params, generator,
                                                              None)
        conf = None
        if d.confidence_head is not None:
            e = d.markov_head.prev_embed(prev_all) if cfg.confidence_head_with_markov else None
            conf = apply_sts(d.confidence_head(h, e), cfg.sts_temperatures)
        return DraftProposal(tokens=toks, q=qs, conf_logits=conf, draft_ids=d.draft_ids, logits=gs,
                             draft_index=idxs)

    def _body(self, inputs: torch.Tensor, kv: torch.Tensor, Bb: int, Lb: int, greedy: bool):
        """The drafting round on B_b rows with L_b context slots -> (h [B_b, γ, d], U [B_b, γ, V_d] fp32, the greedy
        Markov loop's (predecessors, tokens, draft indices, q, g) or None)."""
        d = self.drafter
        anchors, plen, clen = inputs[:Bb], inputs[Bb:2 * Bb], inputs[2 * Bb:]
        ctx_mask = torch.arange(Lb, device=inputs.device) < clen[:, None]  # [B_b, L_b]
        h, U = d._block_forward(anchors, plen, kv, ctx_mask)
        loop = d._sequential_loop(anchors, h, U, GREEDY, None, None) if greedy else None
        return h, U, loop
