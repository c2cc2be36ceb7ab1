"""DSparkDrafter: the parallel block drafter (DFlash-style backbone, docs/dspark.md §2) + Markov head (§3) + confidence
head (§4).  One set of modules, two paths:

  (a) training, teacher-forced, all anchors at once:
        h = drafter.forward_train(aux_hidden [B,T,n·d], input_ids [B,T], anchors [B,S], valid [B,S])  # [B,S,γ,d]
        out = drafter.block_logits(h, prev [B,S,γ], rows [B,S,γ])   # logits [N,V_d], conf_logits [N]
  (b) inference, per-request incremental context cache:
        st = drafter.new_state();  drafter.extend_context(st, aux [n_new,n·d], start_pos)
        prop = drafter.propose([st, ...], anchors [B], params, generator)             # DraftProposal

Notation: d hidden, n aux layers, H/K query/kv heads, h head_dim, γ block_size, V target vocab, V_d draft vocab,
T context tokens, S anchors per sequence.  Block at anchor position p: slot j (0..γ-1) sits at position p+j, slot 0
holds the anchor's embedding, slots 1..γ-1 the (frozen) mask-token embedding, and slot k-1 predicts x_k = token[p+k].

Attention (layer ℓ, block states X): queries from X only; keys/values = [proj(H_ctx); proj(X)] where
H_ctx = hidden_norm(fc(aux)) is shared by all layers.  A block query sees context t < p (and t >= p-W with a context
window W) plus all γ slots of its own block -- never another block.  Inference is the same computation with the
context K/V cached per request (RoPE applied at absolute positions before caching).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

from pipeline.dspark.calibration import apply_sts
from pipeline.dspark.confidence_head import ConfidenceHead
from pipeline.ops.layers import RMSNorm, Rotary, apply_rope
from pipeline.dspark.config import DrafterConfig
from pipeline.ops.packed_linear import Linear
from pipeline.ops.sampling import SamplingParams, probs_from_logits, sample_from_probs
from pipeline.dspark.target_weights import load_target_weights
from pipeline.dspark.markov_head import build_sequential_head


# ---------------------------------------------------------------------------------------------------------------
# building blocks (Qwen3-style)
# ---------------------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, H, K, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.K, self.h = H, K, h
        b = cfg.attention_bias
        self.q_proj = Linear(d, H * h, bias=b)
        self.k_proj = Linear(d, K * h, bias=b)
        self.v_proj = Linear(d, K * h, bias=b)
        self.o_proj = Linear(H * h, d, bias=b)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin):
        """x [B, L, d] -> k, v [B, K, L, h] (k normed + roped).  Used for context AND block tokens."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.K, self.h)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.K, self.h).transpose(1, 2)
        return apply_rope(k, cos[:, None], sin[:, None]), v  # cos/sin [B, L, h] -> [B, 1, L, h]

    def q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, L, d] -> q [B, H, L, h] (normed + roped)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.H, self.h)).transpose(1, 2)
        return apply_rope(q, cos[:, None], sin[:, None])

    def out(self, a: torch.Tensor) -> torch.Tensor:  # [B, H, L, h] -> [B, L, d]
        B, _, L, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(B, L, self.H * self.h))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attend) -> torch.Tensor:
        """x [B, Q, d] block states; `attend(q, k_blk, v_blk) -> [B, H, Q, h]` supplies the context K/V + mask."""
        y = self.input_layernorm(x)
        k, v = self.self_attn.kv(y, cos, sin)
        a = attend(self.self_attn.q(y, cos, sin), k, v)
        x = x + self.self_attn.out(a)
        return x + self.mlp(self.post_attention_layernorm(x))


def _sdpa(q, k, v, mask):
    """q [B,H,Q,h], k/v [B,K,L,h], mask [B,1,Q,L] bool (True = attend)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# ---------------------------------------------------------------------------------------------------------------
# inference state and outputs
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DraftState:
    """One request's draft context: per-layer K/V of the injected (verified) context features.

    kv [num_layers, 2, K, capacity, h]; slot i holds absolute position `start + i`; positions [start, length) are
    valid.  `length` = number of context tokens = the position of the next anchor.
    """
    kv: torch.Tensor
    length: int = 0
    start: int = 0

    @property
    def cached(self) -> int:
        return self.length - self.start


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, γ] int64 TARGET ids x_1..x_γ
    q: torch.Tensor  # [B, γ, V_d] fp32: the distributions the tokens were sampled from (verify with these)
    conf_logits: torch.Tensor | None  # [B, γ] fp32, STS temperatures applied; c_k = sigmoid(conf_logits)
    draft_ids: torch.Tensor  # [V_d] int64: target id of each draft-vocab index
    logits: torch.Tensor  # [B, γ, V_d] fp32 Markov-corrected logits g_k (before temperature / top-k / top-p)
    draft_index: torch.Tensor  # [B, γ] int64 draft-vocab index of each token (tokens = draft_ids[draft_index])


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [N, V_d] Markov-corrected draft logits g (module dtype)
    conf_logits: torch.Tensor | None  # [N] fp32 raw (no STS) confidence logits


# ---------------------------------------------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------------------------------------------
class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, attn_chunk_queries: int = 64):
        super().__init__()
        self.cfg = cfg
        d, n, V, Vd = cfg.hidden_size, cfg.num_aux_layers, cfg.vocab_size, cfg.draft_vocab_size
        self.attn_chunk_queries = attn_chunk_queries  # training: block queries per attention call (memory bound)
        # frozen, copied from the target (load_frozen / from_target / checkpoint.load_drafter)
        self.embed_tokens = nn.Embedding(V, d)
        self.lm_head = Linear(d, Vd, bias=False)  # rows = draft vocab
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        # trainable
        self.fc = Linear(n * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_head = build_sequential_head(cfg, self.embed_tokens)
        self.confidence_head = (ConfidenceHead(d, cfg.markov_rank if cfg.confidence_head_with_markov else 0)
                                if cfg.enable_confidence_head else None)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        # draft vocab: draft index i <-> target id draft_ids[i]; t2d[target id] = draft index or -1
        self.register_buffer("draft_ids", torch.arange(Vd, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.arange(V, dtype=torch.long).masked_fill(torch.arange(V) >= Vd, -1),
                             persistent=False)
        self._init_trainable()

    # --- setup -------------------------------------------------------------------------------------------------
    def _init_trainable(self, std: float = 0.02):
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear) and m is not self.lm_head and not name.startswith(("markov_head",
                                                                                          "confidence_head")):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids [V_d] int64, strictly increasing target ids (draft index i -> target id draft_ids[i])."""
        cfg = self.cfg
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten().cpu()
        if draft_ids.numel() != cfg.draft_vocab_size:
            raise ValueError(f"draft_ids has {draft_ids.numel()} entries, draft_vocab_size is {cfg.draft_vocab_size}")
        if draft_ids.numel() and (draft_ids.min() < 0 or draft_ids.max() >= cfg.vocab_size):
            raise ValueError(f"draft_ids must be target ids in [0, {cfg.vocab_size})")
        if (draft_ids[1:] <= draft_ids[:-1]).any():
            raise ValueError("draft_ids must be strictly increasing (d2t convention: target = i + d2t[i])")
        t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        t2d[draft_ids] = torch.arange(draft_ids.numel())
        dev = self.fc.weight.device
        self.draft_ids = draft_ids.to(dev)
        self.t2d = t2d.to(dev)

    @torch.no_grad()
    def load_frozen(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, d] and FULL output head [V, d]; keep the draft-vocab rows."""
        V, d = self.cfg.vocab_size, self.cfg.hidden_size
        if tuple(embed_weight.shape) != (V, d) or tuple(lm_head_weight.shape) != (V, d):
            raise ValueError(f"target embed/lm_head must be [{V}, {d}], got {tuple(embed_weight.shape)} / "
                             f"{tuple(lm_head_weight.shape)}")
        self.embed_tokens.weight.copy_(embed_weight)
        self.lm_head.weight.copy_(lm_head_weight[self.draft_ids.to(lm_head_weight.device)])

    @classmethod
    def from_target(cls, cfg: DrafterConfig, target, draft_ids: torch.Tensor | None = None, **kw) -> "DSparkDrafter":
        """A fresh drafter whose frozen embed / lm_head come from `target` (transformers model or HF folder)."""
        m = cls(cfg, **kw)
        if draft_ids is not None:
            m.set_draft_vocab(draft_ids)
        tw = load_target_weights(target)
        m.load_frozen(tw.embed, tw.lm_head)
        return m

    @torch.no_grad()
    def init_layers_from(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Start the decoder layers (and the final norm) from target tensors keyed by this drafter's names
        (pipeline.dspark.target_weights.load_target_layers: the target's last layers).  Projections, MLP and layer norms are
        copied; the q/k norms, which a Llama target lacks, keep their weight of 1; fc, hidden_norm and the heads
        keep their own init.  Returns the names set; a shape mismatch or a tensor this drafter lacks is an error."""
        own = dict(self.named_parameters())
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise ValueError(f"target layer tensors without a drafter counterpart: {unknown[:4]} (the target's "
                             "layers must be Llama / Qwen-style: q/k/v/o projections, gate/up/down MLP, two norms)")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: target tensor {tuple(t.shape)} != drafter {tuple(own[name].shape)}")
            own[name].copy_(t)
        return sorted(tensors)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def context_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux [..., n·d] -> H_ctx [..., d] = hidden_norm(fc(aux))."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def _block_embeddings(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """anchor_tokens [...] -> [..., γ, d]: slot 0 = embed(anchor), slots 1.. = embed(mask)."""
        G = self.cfg.block_size
        ids = torch.full((*anchor_tokens.shape, G), self.cfg.mask_token_id, dtype=torch.long,
                         device=anchor_tokens.device)
        ids[..., 0] = anchor_tokens
        return self.embed_tokens(ids)

    # --- heads (shared by both paths) --------------------------------------------------------------------------
    def block_logits(self, h: torch.Tensor, prev: torch.Tensor, rows: torch.Tensor | None = None) -> BlockOutput:
        """Teacher-forced heads.  h [..., γ, d] normed backbone output, prev [..., γ] target ids x_{k-1} (slot 0 =
        anchor), rows [..., γ] bool: which slots to return (None = all).  -> logits [N, V_d], conf [N]."""
        head = self.markov_head
        z = head.latent(prev, h)  # [..., γ, r] (cheap; the RNN needs the whole block)
        e = z if head.head_type == "vanilla" else head.prev_embed(prev)
        if rows is None:
            rows = torch.ones(prev.shape, dtype=torch.bool, device=prev.device)
        h_r = h[rows]  # [N, d]
        logits = self.lm_head(h_r)  # U [N, V_d]
        if z is not None:
            logits = head.add_bias(logits, z[rows])  # g = U + W2 z
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head(h_r, e[rows] if self.cfg.confidence_head_with_markov else None)
        return BlockOutput(logits, conf)

    # --- (a) training path -------------------------------------------------------------------------------------
    def forward_train(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
        """aux_hidden [B,T,n·d], input_ids [B,T], anchors [B,S] (positions p, best sorted ascending), valid [B,S]
        (False = dummy block: sees only its own block, excluded from the loss) -> h [B,S,γ,d] (after `norm`)."""
        cfg, G = self.cfg, self.cfg.block_size
        B, T, _ = aux_hidden.shape
        S = anchors.shape[1]
        dev = aux_hidden.device
        anchors = anchors.long()
        if valid is None:
            valid = torch.ones_like(anchors, dtype=torch.bool)
        anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
        dt = self.fc.weight.dtype

        H_ctx = self.context_features(aux_hidden)  # [B,T,d]
        ctx_cos, ctx_sin = self.rotary(torch.arange(T, device=dev).expand(B, T), dt)
        x = self._block_embeddings(input_ids.long().gather(1, anchors)).reshape(B, S * G, -1).to(dt)  # [B,S·γ,d]
        pos = (anchors[:, :, None] + torch.arange(G, device=dev)).reshape(B, S * G)
        cos, sin = self.rotary(pos, dt)
        plan = self._train_attention_plan(anchors, valid, T)

        for layer in self.layers:
            kc, vc = layer.self_attn.kv(H_ctx, ctx_cos, ctx_sin)  # [B,K,T,h]

            def attend(q, kb, vb, kc=kc, vc=vc):
                outs = []
                for (q0, q1, t0, t1, mask) in plan:
                    k = torch.cat([kc[:, :, t0:t1], kb[:, :, q0:q1]], dim=2)
                    v = torch.cat([vc[:, :, t0:t1], vb[:, :, q0:q1]], dim=2)
                    outs.append(_sdpa(q[:, :, q0:q1], k, v, mask))
                return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

            x = layer(x, cos, sin, attend)
        return self.norm(x).view(B, S, G, -1)

    def _train_attention_plan(self, anchors, valid, T):
        """Split the S blocks into chunks of ~attn_chunk_queries queries; each chunk only reads the context range it
        can see.  Returns [(q0, q1, t0, t1, mask [B,1,Q,(t1-t0)+Q])]."""
        G, W = self.cfg.block_size, self.cfg.context_window
        B, S = anchors.shape
        dev = anchors.device
        per = max(1, self.attn_chunk_queries // G)
        plan = []
        for s0 in range(0, S, per):
            s1 = min(S, s0 + per)
            a = anchors[:, s0:s1]  # [B,C]
            vd = valid[:, s0:s1]
            t1 = int(a.max()) if a.numel() else 0
            t1 = min(t1, T)
            t0 = 0
            if W is not None:
                lo = torch.where(vd, (a - W).clamp_min(0), torch.full_like(a, t1))
                t0 = min(int(lo.min()), t1)
            C = s1 - s0
            t = torch.arange(t0, t1, device=dev)
            # context part: t < p (and t >= p - W); dummies see no context
            ctx = (t[None, None, :] < a[:, :, None]) & vd[:, :, None]
            if W is not None:
                ctx &= t[None, None, :] >= (a[:, :, None] - W)
            ctx = ctx[:, :, None, :].expand(B, C, G, t1 - t0).reshape(B, C * G, t1 - t0)
            blk = torch.arange(C, device=dev).repeat_interleave(G)
            own = (blk[:, None] == blk[None, :]).expand(B, C * G, C * G)
            mask = torch.cat([ctx, own], dim=2)[:, None]  # [B,1,C·γ,ctx+C·γ]
            plan.append((s0 * G, s1 * G, t0, t1, mask))
        return plan

    # --- (b) inference path ------------------------------------------------------------------------------------
    def new_state(self, capacity: int = 256) -> DraftState:
        c = self.cfg
        kv = torch.empty(c.num_hidden_layers, 2, c.num_key_value_heads, capacity, c.head_dim,
                         dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        return DraftState(kv=kv)

    @staticmethod
    def truncate(state: DraftState, length: int) -> None:
        """Forget context positions >= length (they must not have been dropped by the window already)."""
        if length > state.length:
            raise ValueError(f"truncate: length {length} > context length {state.length}")
        if length < state.start:
            raise ValueError(f"truncate: positions < {state.start} were dropped by the context window")
        state.length = length

    @torch.no_grad()
    def extend_context(self, state: DraftState, aux_hidden: torch.Tensor, start_pos: int | None = None) -> None:
        """Append verified tokens' target features.  aux_hidden [n_new, n·d] for absolute positions
        start_pos .. start_pos+n_new-1 (default: the current length).  start_pos < length first truncates (re-write)."""
        self.extend_contexts([state], [aux_hidden], [start_pos])

    @torch.no_grad()
    def extend_contexts(self, states: Sequence[DraftState], aux_list: Sequence[torch.Tensor],
                        start_positions: Sequence[int | None] | None = None) -> None:
        """Batched `extend_context`: one fc / projection pass over all requests' new tokens."""
        if start_positions is None:
            start_positions = [None] * len(states)
        dt, dev = self.fc.weight.dtype, self.fc.weight.device
        W = self.cfg.context_window
        starts, sizes = [], []
        for st, aux, sp in zip(states, aux_list, start_positions):
            sp = st.length if sp is None else int(sp)
            if aux.dim() != 2 or aux.shape[1] != self.fc.in_features:
                raise ValueError(f"extend_context: aux_hidden must be [n_new, {self.fc.in_features}], "
                                 f"got {tuple(aux.shape)}")
            if sp > st.length:
                raise ValueError(f"extend_context: start_pos {sp} leaves a gap after context length {st.length}")
            self.truncate(st, sp)
            starts.append(sp)
            sizes.append(aux.shape[0])
        if sum(sizes) == 0:
            return
        aux = torch.cat([a.to(device=dev) for a in aux_list], 0)
        H = self.context_features(aux)[None]  # [1, N, d]
        pos = torch.cat([torch.arange(s, s + n, device=dev) for s, n in zip(starts, sizes)])[None]
        cos, sin = self.rotary(pos, dt)
        kvs = []
        for layer in self.layers:
            k, v = layer.self_attn.kv(H, cos, sin)  # [1,K,N,h]
            kvs.append(torch.stack([k[0], v[0]]))  # [2,K,N,h]
        kv_new = torch.stack(kvs)  # [layers,2,K,N,h]
        off = 0
        for st, n in zip(states, sizes):
            self._write(st, kv_new[..., off:off + n, :], W)
            off += n

    @staticmethod
    def _write(st: DraftState, kv_new: torch.Tensor, W: int | None) -> None:
        """Append kv_new [layers,2,K,n,h] at positions length..length+n-1 (growing / compacting the buffer)."""
        n = kv_new.shape[3]
        if n == 0:
            return
        new_len = st.length + n
        cap = st.kv.shape[3]
        if W is not None and st.cached + n > cap:
            # full: first drop positions no future anchor (at >= new_len) can see, i.e. < new_len - W
            keep_from = min(max(st.start, new_len - W), st.length)
            drop = keep_from - st.start
            if drop > 0:
                st.kv[..., :st.cached - drop, :] = st.kv[..., drop:st.cached, :].clone()
                st.start = keep_from
        c = st.cached
        if c + n > cap:
            grown = st.kv.new_empty(*st.kv.shape[:3], max(c + n, 2 * cap), st.kv.shape[4])
            grown[..., :c, :] = st.kv[..., :c, :]
            st.kv = grown
        st.kv[..., c:c + n, :] = kv_new.to(st.kv.dtype)
        st.length = new_len

    def _gather_context(self, states: Sequence[DraftState]):
        """-> kv [layers,2,B,K,L,h] (window slices, right-padded), ctx_mask [B,L] bool."""
        W = self.cfg.context_window
        lo = [max(st.start, st.length - W) if W is not None else st.start for st in states]
        lens = [st.length - l for st, l in zip(states, lo)]
        L = max(lens)
        if len(states) == 1:
            st = states[0]
            o = lo[0] - st.start
            kv = st.kv[..., o:o + L, :][:, :, None]
            return kv, torch.ones(1, L, dtype=torch.bool, device=kv.device)
        ref = states[0].kv
        kv = ref.new_zeros(ref.shape[0], 2, len(states), ref.shape[2], L, ref.shape[4])
        mask = torch.zeros(len(states), L, dtype=torch.bool, device=ref.device)
        for b, (st, l, n) in enumerate(zip(states, lo, lens)):
            o = l - st.start
            kv[:, :, b, :, :n] = st.kv[..., o:o + n, :]
            mask[b, :n] = True
        return kv, mask

    @torch.no_grad()
    def propose(self, states: Sequence[DraftState], anchors: torch.Tensor,
                params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
                forced_tokens: torch.Tensor | None = None) -> DraftProposal:
        """One draft round for B requests.  anchors [B] target ids (each at position = its state's length).

        Backbone on [anchor, mask×(γ-1)] attending to the cached context, then the Markov loop: for k = 1..γ,
        g_k = U_k + bias(x_{k-1}); q_k = probs_from_logits(g_k) (fp32); x_k ~ q_k (sample_from_probs); then the
        confidence logits on the sampled predecessors.  `forced_tokens` [B, γ] (target ids) replaces sampling
        (teacher forcing: tests / evaluation); q is still reported.
        """
        cfg, dev = self.cfg, self.fc.weight.device
        B = len(states)
        anchors = torch.as_tensor(anchors, dtype=torch.long, device=dev).view(B)
        plen = torch.tensor([st.length for st in states], device=dev)
        # record_function labels: the parts of a drafting round in a profile (jobs.bench draft_budget)
        with record_function("draft.block_forward"):
            kv, ctx_mask = self._gather_context(states)
            h, U = self._block_forward(anchors, plen, kv, ctx_mask)
        with record_function("draft.sequential_loop"):
            prev_all, toks, idxs, qs, gs = self._sequential_loop(anchors, h, U, params, generator, forced_tokens)
        conf = None
        if self.confidence_head is not None:
            with record_function("draft.confidence"):
                e = self.markov_head.prev_embed(prev_all) if cfg.confidence_head_with_markov else None
                conf = apply_sts(self.confidence_head(h, e), cfg.sts_temperatures)
        return DraftProposal(tokens=toks, q=qs, conf_logits=conf, draft_ids=self.draft_ids, logits=gs,
                             draft_index=idxs)

    def _block_forward(self, anchors: torch.Tensor, plen: torch.Tensor, kv: torch.Tensor, ctx_mask: torch.Tensor):
        """The backbone on [anchor, mask×(γ-1)] of B rows, each attending to its cached context and its own block.

        anchors [B] target ids at positions plen [B]; kv [layers,2,B,K,L,h] and ctx_mask [B,L] bool (True = a
        context slot to attend to), as ``_gather_context`` lays them out -> h [B,γ,d], U [B,γ,V_d] fp32."""
        G = self.cfg.block_size
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        B, L = ctx_mask.shape
        x = self._block_embeddings(anchors).to(dt)  # [B,γ,d]
        cos, sin = self.rotary(plen[:, None] + torch.arange(G, device=dev), dt)
        mask = torch.cat([ctx_mask[:, None, :].expand(B, G, L),
                          torch.ones(B, G, G, dtype=torch.bool, device=dev)], dim=2)[:, None]  # [B,1,γ,L+γ]
        for i, layer in enumerate(self.layers):
            kc, vc = kv[i, 0], kv[i, 1]

            def attend(q, kb, vb, kc=kc, vc=vc):
                return _sdpa(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)

            x = layer(x, cos, sin, attend)
        h = self.norm(x)  # [B,γ,d]
        return h, self.lm_head(h).float()  # U [B,γ,V_d]

    def _sequential_loop(self, anchors, h, U, params, generator, forced_tokens):
        """The Markov / RNN loop over the block: g_k = U_k + bias(x_{k-1}), q_k, x_k ~ q_k (or forced).
        -> predecessors [B,γ] (anchor, x_1..x_{γ-1}), tokens [B,γ], draft indices [B,γ], q [B,γ,V_d], g [B,γ,V_d]."""
        B, dev = h.shape[0], h.device
        head = self.markov_head
        per_row = not isinstance(params, SamplingParams)
        if per_row and len(params) != B:
            raise ValueError(f"propose: {len(params)} SamplingParams for {B} requests")
        greedy = all(p.greedy for p in params) if per_row else params.greedy
        hstate = head.init_state(B, dev, h.dtype)
        # greedy drafting: q_k is the one-hot of the argmax (probs_from_logits), built for the whole block at the end
        one_hot_q = greedy and forced_tokens is None
        prev = anchors
        prevs, toks, idxs, qs, gs = [], [], [], [], []
        for k in range(self.cfg.block_size):
            bias, hstate = head.step(prev, h[:, k], hstate)
            g = U[:, k] if bias is None else U[:, k] + bias.float()  # [B,V_d] fp32
            if not one_hot_q:
                qs.append(probs_from_logits(g, params) if not per_row else
                          torch.stack([probs_from_logits(g[b], params[b]) for b in range(B)]))
            if forced_tokens is not None:
                tok = forced_tokens[:, k].to(dev).long()
                idx = self.t2d[tok]
                if (idx < 0).any():
                    raise ValueError("forced_tokens contain ids outside the draft vocabulary")
            elif greedy:  # = inverse-CDF sampling of the one-hot q, without its fp64 cumsum over V_d
                idx = g.argmax(-1)
                tok = self.draft_ids[idx]
            else:
                idx = _sample(qs[-1], generator)
                tok = self.draft_ids[idx]
            prevs.append(prev)
            toks.append(tok)
            idxs.append(idx)
            gs.append(g)
            prev = tok
        idx_all = torch.stack(idxs, 1)  # [B,γ]
        gs = torch.stack(gs, 1)  # [B,γ,V_d]
        if one_hot_q:  # ties: the lowest index, as torch.argmax and probs_from_logits
            q_all = torch.zeros_like(gs).scatter_(-1, idx_all[..., None], 1.0)
        else:
            q_all = torch.stack(qs, 1)
        return torch.stack(prevs, 1), torch.stack(toks, 1), idx_all, q_all, gs


def _sample(q: torch.Tensor, generator) -> torch.Tensor:
    """q [B, V_d] fp32 -> draft indices [B]; one generator for the batch or one per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return sample_from_probs(q, generator)
    return torch.stack([sample_from_probs(q[b:b + 1], g)[0] for b, g in enumerate(generator)])
