"""Sequential (Markov) logit-bias heads of DSpark (docs/dspark.md §3).

Step-k logits are g_k = U_k + bias_k, where U_k = lm_head(h_k) are the parallel backbone's base logits and bias_k
depends on the previous token x_{k-1} (x_0 = the anchor).  Every head factors into a cheap rank-r *latent*
z_k and one shared projection W2 (`markov_w2`, r -> V_d):

    vanilla  z_k = W1[x_{k-1}]
    gated    z_k = σ(W_g [h_k; W1[x_{k-1}]] + b) ⊙ W1[x_{k-1}]                      (`gate_proj`)
    rnn      [g; c; o] = W_j [s_{k-1}; W1[x_{k-1}]; h_k] + b,                        (`joint_proj`)
             s_k = σ(g) ⊙ s_{k-1} + (1-σ(g)) ⊙ tanh(c),  s_0 = 0,   z_k = tanh(o)
    bias_k = W2 z_k

W1 (`markov_w1`, Embedding [V, r]) is indexed by TARGET token ids; W2 rows are draft-vocab indices.

W1 as trained (`DrafterConfig.markov_w1_source`, training only -- the exported checkpoint always holds the plain
[V, r] table):
  * "table": W1 is a free per-token table (the paper's head).  A token the training data never showed as a
    block's previous token keeps its random row.
  * "embedding": W1 = rmsnorm(E) P^T + R, E the target's frozen input embedding [V, d], P (`markov_w1_proj`,
    [r, d]) shared by all tokens, R the zero-initialised per-token table (`markov_w1`).  Tokens that are rare in
    the training data get a latent from what the target's embedding knows of them; frequent ones refine it in R.
    `materialize_w1()` folds it into one table for export; the step- and teacher-forced paths are unchanged.

Two paths over the same parameters:
  * `latent(prev [..., γ], h [..., γ, d]) -> z [..., γ, r]`: teacher-forced, all positions at once (the RNN unrolls
    its γ steps, vectorised over everything else).  `bias = project(latent)`; the trainer projects only the rows it
    supervises.
  * `step(prev [B], h_k [B, d], state) -> (bias [B, V_d], state)`: one inference step.  The RNN CARRIES its state
    (DeepSpec's `compute_step_bias` restarts from zero -- docs/dspark.md §10.11 -- which is wrong).

`NoHead` (markov_rank = 0) is the DFlash baseline: `bias`/`step` return None.

The vanilla head's step bias depends on the previous token alone, so on CPU its inference step keeps the biases of
recently seen tokens (`BiasCache`): a hit reads one [V_d] row instead of streaming all of W2 (V_d x r) per step,
which is most of the sequential loop's time.  The cache follows the weights (any in-place update or new tensor
empties it) and is never used while autograd records (training).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.ops.packed_linear import Linear


class _RowGatherIntoGrad(torch.autograd.Function):
    """W1[idx] whose backward ADDS the touched rows straight into W1.grad (``index_add_``) instead of returning a
    dense [V, r] gradient.  Autograd's embedding backward allocates and zero-fills a fresh [V, r] tensor per
    backward (49152 x 256 fp32 = 50 MB for SmolLM2, most of its time spent faulting in fresh pages) and then adds it
    into .grad; this writes only the rows a batch used, into a gradient buffer that is reused across steps.  The
    value of W1.grad after backward is exactly the same."""

    @staticmethod
    def forward(ctx, weight, idx, head):
        ctx.save_for_backward(idx)
        ctx.head = head
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        ctx.head._add_w1_grad(idx, grad_out)
        return None, None, None


class BiasCache:
    """Token -> bias row W2 z(token) for heads whose step bias depends on the previous token only (vanilla), least
    recently used rows evicted first.  ``capacity_bytes`` bounds the row buffer (rows = capacity_bytes / (V_d x
    itemsize), at least 64).  A row is the same computation as the uncached step (`project(prev_embed(t))`), done
    once per token in whatever batch first missed it; only the draft proposal depends on it, never what the target
    verifies."""

    def __init__(self, capacity_bytes: int = 64 << 20):
        self.capacity_bytes = int(capacity_bytes)
        self.key = None
        self.hits = self.misses = 0

    def _reset(self, key, vocab: int, width: int, dtype, device) -> None:
        rows = max(64, self.capacity_bytes // max(1, width * torch.empty((), dtype=dtype).element_size()))
        with torch.inference_mode(False):  # plain tensors: updated in place under inference_mode and no_grad alike
            self.slot_of = torch.full((vocab,), -1, dtype=torch.long, device=device)  # token -> row, -1 absent
            self.token_of = torch.full((rows,), -1, dtype=torch.long, device=device)  # row -> token
            self.last_used = torch.zeros(rows, dtype=torch.long, device=device)  # row -> tick of its last use
            self.rows = torch.empty(rows, width, dtype=dtype, device=device)
        self.tick, self.key = 1, key

    def bias(self, head: "VanillaMarkovHead", prev: torch.Tensor) -> torch.Tensor:
        """prev [B] target ids -> bias [B, V_d] (the head's projection dtype)."""
        key = tuple((id(p), p._version, p.dtype, p.device) for p in head.parameters())
        if self.key != key:
            w2 = head.markov_w2.weight
            self._reset(key, head.markov_w1.weight.shape[0], w2.shape[0], w2.dtype, w2.device)
        slots = self.slot_of[prev]
        miss = slots < 0
        n_miss = int(miss.sum())
        self.last_used[slots[~miss]] = self.tick
        if n_miss:
            new = prev[miss].unique()
            free = int((self.last_used < self.tick).sum())
            if new.numel() > free:  # more new tokens than rows not used by this batch: no caching this step
                self.misses += prev.numel()
                return head.project(head.prev_embed(prev))
            victims = torch.topk(self.last_used, new.numel(), largest=False).indices
            old = self.token_of[victims]
            self.slot_of[old[old >= 0]] = -1
            self.rows[victims] = head.project(head.prev_embed(new)).to(self.rows.dtype)
            self.token_of[victims] = new
            self.slot_of[new] = victims
            self.last_used[victims] = self.tick
            slots = self.slot_of[prev]
        self.misses += n_miss
        self.hits += prev.numel() - n_miss
        self.tick += 1
        return self.rows[slots]


class NoHead(nn.Module):
    """DFlash: no sequential stage."""

    rank = 0
    head_type = "none"

    def prev_embed(self, prev: torch.Tensor):
        return None

    def init_state(self, batch: int, device=None, dtype=None):
        return None

    def latent(self, prev, h):
        return None

    def project(self, z):
        return None

    def add_bias(self, base, z):
        return base

    def bias(self, prev, h):
        return None

    def step(self, prev, h_k, state):
        return None, state


class VanillaMarkovHead(nn.Module):
    head_type = "vanilla"
    step_bias_depends_on_prev_only = True

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 target_embed: nn.Embedding | None = None):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r], rows = target ids
        self.markov_w2 = Linear(rank, draft_vocab_size, bias=False)  # [V_d, r]
        # start as DFlash (bias 0); W2 gets gradient at once because W1 is random
        nn.init.zeros_(self.markov_w2.weight)
        self._w1_grad_buffer: torch.Tensor | None = None  # reused W1.grad storage (see _RowGatherIntoGrad)
        # W1 source "embedding" (module docstring): the drafter's frozen target embedding, held in a tuple so it
        # is not registered (and saved) twice; markov_w1 becomes the zero-initialised residual table R
        self._target_embed = (target_embed,) if target_embed is not None else None
        # inference-step bias rows by previous token (CPU only; None = off); GatedMarkovHead / RNNMarkovHead mix in
        # h_k, so they never cache
        self.bias_cache: BiasCache | None = BiasCache() if self.step_bias_depends_on_prev_only else None
        if target_embed is not None:
            self.markov_w1_proj = nn.Linear(hidden_size, rank, bias=False)  # P [r, d]
            nn.init.normal_(self.markov_w1_proj.weight, std=hidden_size ** -0.5)  # unit-variance latents, as W1's
            nn.init.zeros_(self.markov_w1.weight)

    @property
    def w1_from_embedding(self) -> bool:
        return self._target_embed is not None

    def _embedding_latent(self, ids: torch.Tensor) -> torch.Tensor:  # [...] target ids -> [..., r]
        e = self._target_embed[0](ids)
        e = F.rms_norm(e.float(), (e.shape[-1],), eps=1e-6)  # no weight: the scale is P's
        return self.markov_w1_proj(e.to(self.markov_w1_proj.weight.dtype))

    @torch.no_grad()
    def materialize_w1(self) -> torch.Tensor:
        """The [V, r] table the exported checkpoint holds: W1 itself, or rmsnorm(E) P^T + R."""
        w = self.markov_w1.weight
        if not self.w1_from_embedding:
            return w.detach().clone()
        ids = torch.arange(w.shape[0], device=w.device)
        return torch.cat([self._embedding_latent(c) for c in ids.split(8192)]).to(w.dtype) + w

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:  # [...] target ids -> [..., r]
        w = self.markov_w1.weight
        if torch.is_grad_enabled() and w.requires_grad:
            table = _RowGatherIntoGrad.apply(w, prev, self)
        else:
            table = self.markov_w1(prev)
        if self.w1_from_embedding:
            return table + self._embedding_latent(prev).to(table.dtype)
        return table

    def _add_w1_grad(self, idx: torch.Tensor, grad_out: torch.Tensor) -> None:
        """W1.grad[idx] += grad_out (rows repeated in idx add up), creating W1.grad from the reused buffer."""
        w = self.markov_w1.weight
        if w.grad is None:
            buf = self._w1_grad_buffer
            if buf is None or buf.shape != w.shape or buf.dtype != w.dtype or buf.device != w.device:
                buf = torch.zeros_like(w)
            else:
                buf.zero_()
            self._w1_grad_buffer = buf
            w.grad = buf
        w.grad.index_add_(0, idx.reshape(-1), grad_out.reshape(-1, w.shape[1]).to(w.grad.dtype))

    def init_state(self, batch: int, device=None, dtype=None):
        return None

    def _latent_step(self, e, h_k, state):  # e [..., r], h_k [..., d] -> (z [..., r], state)
        return e, state

    def latent(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """prev [..., γ] target ids, h [..., γ, d] -> z [..., γ, r] (teacher-forced, parallel)."""
        return self.prev_embed(prev)

    def project(self, z: torch.Tensor) -> torch.Tensor:  # [..., r] -> [..., V_d]
        return self.markov_w2(z)

    def add_bias(self, base: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """base [N, V_d] + W2 z [N, r]: one fused GEMM-with-accumulate (no extra [N, V_d] pass)."""
        if base.dim() == 2 and base.dtype == z.dtype:
            return torch.addmm(base, z, self.markov_w2.weight.t())
        return base + self.project(z).to(base.dtype)

    def bias(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # -> [..., γ, V_d]
        return self.project(self.latent(prev, h))

    def step(self, prev: torch.Tensor, h_k: torch.Tensor, state):
        """prev [B] target ids, h_k [B, d] -> (bias [B, V_d], new state)."""
        if self.bias_cache is not None and prev.device.type == "cpu" and not torch.is_grad_enabled():
            return self.bias_cache.bias(self, prev), state
        z, state = self._latent_step(self.prev_embed(prev), h_k, state)
        return self.project(z), state


class GatedMarkovHead(VanillaMarkovHead):
    head_type = "gated"
    step_bias_depends_on_prev_only = False

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, target_embed=None):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size, target_embed)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)  # [h; e] -> gate

    def _latent_step(self, e, h_k, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([h_k.to(e.dtype), e], dim=-1)))
        return gate * e, state

    def latent(self, prev, h):
        return self._latent_step(self.prev_embed(prev), h, None)[0]


class RNNMarkovHead(VanillaMarkovHead):
    head_type = "rnn"
    step_bias_depends_on_prev_only = False

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, target_embed=None):
        super().__init__(vocab_size, draft_vocab_size, rank, hidden_size, target_embed)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [s; e; h] -> [gate; cand; out]

    def init_state(self, batch: int, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(batch, self.rank, device=device, dtype=dtype or self.markov_w1.weight.dtype)

    def _latent_step(self, e, h_k, state):
        if state is None:
            state = torch.zeros_like(e)
        g, c, o = self.joint_proj(torch.cat([state, e, h_k.to(e.dtype)], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        new_state = g * state + (1.0 - g) * torch.tanh(c)
        return torch.tanh(o), new_state

    def latent(self, prev, h):
        e = self.prev_embed(prev)  # [..., γ, r]
        state = torch.zeros_like(e[..., 0, :])
        zs = []
        for k in range(e.shape[-2]):  # γ steps, vectorised over all blocks
            z, state = self._latent_step(e[..., k, :], h[..., k, :], state)
            zs.append(z)
        return torch.stack(zs, dim=-2)


HEADS = {"vanilla": VanillaMarkovHead, "gated": GatedMarkovHead, "rnn": RNNMarkovHead}


def build_sequential_head(cfg, target_embed: nn.Embedding | None = None) -> nn.Module:
    """cfg: DrafterConfig; target_embed: the drafter's frozen target embedding (needed for markov_w1_source
    "embedding")."""
    if cfg.markov_rank == 0:
        return NoHead()
    if cfg.markov_w1_source == "embedding":
        if target_embed is None:
            raise ValueError("markov_w1_source='embedding' needs the target embedding")
    else:
        target_embed = None
    return HEADS[cfg.markov_head_type](cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank, cfg.hidden_size,
                                       target_embed)
