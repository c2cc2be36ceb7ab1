"""An honest test drafter implementing the drafter inference contract (pipeline/engine/engine.py docstring) with a second
tiny LM, plus the tiny models the engine tests use.

* It learns the context TOKENS from the injected aux hidden states: aux layer id 0 is the target's embedding output,
  so each context row is matched back to its token by nearest embedding.  That also checks the engine's bookkeeping:
  ``extend_context`` must arrive with consecutive ``start_pos`` values, and the verified tokens it reveals must be
  the anchor followed by the drafts this drafter proposed (asserted).
* It proposes autoregressively from its own tiny LM (a TargetRunner over a perturbed copy of the target, so acceptance
  is high but not perfect), optionally over a reduced draft vocabulary (``draft_ids``), sampling each step with
  pipeline.ops.sampling (q = the exact probs the token was drawn from).  conf_logits = log-odds of max_v q_k(v)
  (a function of the prefix x_{<k} only, as DSpark's confidence head).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from pipeline.ops.sampling import SamplingParams, probs_from_logits, sample_from_probs
from pipeline.engine.target_runner import TargetRunner


@dataclass
class ToyDrafterConfig:
    block_size: int
    aux_layer_ids: list
    draft_vocab_size: int


@dataclass
class DraftProposal:
    tokens: torch.Tensor
    q: torch.Tensor
    conf_logits: torch.Tensor | None
    draft_ids: torch.Tensor


@dataclass
class ToyDraftState:
    slot: int
    tokens: list = field(default_factory=list)  # context tokens recovered from aux id 0
    lm_len: int = 0  # tokens of `tokens` already in the draft LM's cache
    last_anchor: int | None = None
    last_drafts: list = field(default_factory=list)
    extend_calls: list = field(default_factory=list)  # (start_pos, n) history


class ToyDrafter:
    def __init__(self, draft_lm: TargetRunner, target_embed: torch.Tensor, block_size: int,
                 aux_layer_ids=(0,), draft_ids: torch.Tensor | None = None, with_confidence: bool = True,
                 lossy_confidence: bool = False):
        assert 0 in aux_layer_ids, "the toy drafter reads tokens back from aux id 0 (embedding output)"
        self.lm = draft_lm
        self.embed = target_embed.float()
        self.d = target_embed.shape[1]
        self.aux_pos0 = list(aux_layer_ids).index(0)
        V = target_embed.shape[0]
        self.draft_ids = torch.arange(V) if draft_ids is None else draft_ids.long()
        self.config = ToyDrafterConfig(block_size, list(aux_layer_ids), int(self.draft_ids.numel()))
        self.with_confidence = with_confidence
        self.lossy_confidence = lossy_confidence  # NEGATIVE CONTROL ONLY: c_k from q_k(x_k), i.e. from x_k itself
        self.live_states = 0

    def new_state(self) -> ToyDraftState:
        self.live_states += 1
        return ToyDraftState(slot=self.lm.alloc())

    def free_state(self, st: ToyDraftState) -> None:
        self.live_states -= 1
        self.lm.free(st.slot)

    def extend_context(self, st: ToyDraftState, aux_hidden: torch.Tensor, start_pos: int) -> None:
        n_aux = len(self.config.aux_layer_ids)
        assert aux_hidden.dim() == 2 and aux_hidden.shape[1] == n_aux * self.d, aux_hidden.shape
        assert start_pos == len(st.tokens), f"extend_context at {start_pos}, context holds {len(st.tokens)}"
        h0 = aux_hidden[:, self.aux_pos0 * self.d:(self.aux_pos0 + 1) * self.d].float()
        toks = torch.cdist(h0, self.embed).argmin(-1).tolist()
        if st.last_anchor is not None:  # verified tokens = [anchor, accepted drafts...]
            assert toks[0] == st.last_anchor, (toks, st.last_anchor)
            assert toks[1:] == st.last_drafts[:len(toks) - 1], (toks, st.last_drafts)
        st.last_anchor, st.last_drafts = None, []  # checked once: a round that drafted nothing reveals no drafts
        st.tokens.extend(toks)
        st.extend_calls.append((start_pos, len(toks)))

    def propose(self, states, anchors: torch.Tensor, params: SamplingParams, generator) -> DraftProposal:
        B, g = len(states), self.config.block_size
        slots = [s.slot for s in states]
        anchors = anchors.tolist()
        inputs = []
        for st, a in zip(states, anchors):
            self.lm.truncate(st.slot, st.lm_len)
            inputs.append(st.tokens[st.lm_len:] + [a])
        toks = torch.empty(B, g, dtype=torch.long)
        qs = torch.empty(B, g, self.config.draft_vocab_size)
        for k in range(g):
            out = self.lm.forward(slots, inputs, logits_last=1)
            logits = out.logits[:, self.draft_ids]
            q = probs_from_logits(logits, params)
            idx = sample_from_probs(q, generator)
            t = self.draft_ids[idx]
            toks[:, k] = t
            qs[:, k] = q
            inputs = [[int(x)] for x in t.tolist()]
        for st, a, row in zip(states, anchors, toks.tolist()):
            self.lm.truncate(st.slot, len(st.tokens))  # cache = context only
            st.lm_len = len(st.tokens)
            st.last_anchor, st.last_drafts = a, row
        conf = None
        if self.with_confidence:
            # like DSpark's head, c_k may depend on the prefix x_{<k} but NEVER on x_k itself (that would make
            # depth rules lossy): the draft distribution's peak probability.
            conf = torch.logit(qs.max(-1).values.clamp(1e-6, 1 - 1e-6))
            if self.lossy_confidence:
                di = torch.full((int(self.draft_ids.max()) + 1,), 0, dtype=torch.long)
                di[self.draft_ids] = torch.arange(self.draft_ids.numel())
                conf = torch.logit(qs.gather(-1, di[toks][..., None])[..., 0].clamp(1e-6, 1 - 1e-6))
        return DraftProposal(tokens=toks, q=qs, conf_logits=conf, draft_ids=self.draft_ids)


# ------------------------------------------------------------------------------------------ tiny models for tests
def tiny_llama(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, inter=64, seed=0, max_pos=512, head_scale=4.0,
               **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)
    m = LlamaForCausalLM(cfg).eval()
    # sharper-than-init logits so greedy decoding is not a coin flip on near-ties
    with torch.no_grad():
        m.lm_head.weight.mul_(head_scale)
    return m


def perturbed_copy(model, noise: float, seed: int = 1):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return m


def make_toy_drafter(target_model, noise=0.3, block_size=4, draft_ids=None, with_confidence=True,
                     max_seq_len=256, dtype="float32", lossy_confidence=False):
    lm = TargetRunner(perturbed_copy(target_model, noise) if noise else target_model, dtype=dtype,
                      max_seq_len=max_seq_len, init_slots=4, init_len=32, device="cpu")
    emb = target_model.model.embed_tokens.weight.detach().float()
    return ToyDrafter(lm, emb, block_size, aux_layer_ids=(0, 1), draft_ids=draft_ids,
                      with_confidence=with_confidence, lossy_confidence=lossy_confidence)


def greedy_reference(model, prompt, n):
    """Plain transformers greedy decoding (full recompute, no cache) -- the ground truth."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            t = int(logits.argmax())
            out.append(t)
            ids.append(t)
    return out


class CharTokenizer:
    """Token i <-> one character (for stop-string tests)."""

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-+*/=()[]{}<>@#$%^&_~|"

    def __init__(self, eos_token_id=None):
        self.eos_token_id = eos_token_id

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i % len(self.alphabet)] for i in ids
                       if not (skip_special_tokens and i == self.eos_token_id))

    def encode(self, s):
        return [self.alphabet.index(c) for c in s]


def joint_counts(outputs, V: int, n: int) -> torch.Tensor:
    """Engine outputs of exactly n tokens each -> counts [V**n] of each n-token sequence (base-V index)."""
    idx = []
    for o in outputs:
        assert len(o.output_ids) == n, o.output_ids
        i = 0
        for t in o.output_ids:
            i = i * V + t
        idx.append(i)
    return torch.bincount(torch.tensor(idx), minlength=V ** n)


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of observed ``counts`` to ``probs``; cells with expected count below
    ``min_expected`` are pooled into one.  Observed mass in zero-probability cells fails the test outright."""
    from scipy.stats import chi2

    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    n = counts.sum()
    if bool(((probs <= 1e-15) & (counts > 0)).any()):
        return 0.0
    exp = probs * n
    small = exp < min_expected
    obs_c = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp_c = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    return float(chi2.sf(stat, max(1, obs_c.numel() - 1)))


def one_thread():
    """Generator for a module-scoped autouse fixture: tiny-model tests run faster on one intra-op thread (and do not
    fight other processes on a shared 2-core machine); the previous setting is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def export_random_drafter(target_dir, out, layers: int = 1, draft_vocab: int = 4096, markov_rank: int = 32):
    """A random-weight DSpark drafter for the real target, exported as a checkpoint folder at ``out`` (returned).
    Non-trivial heads (they start at zero): a positive confidence bias, so some drafts get verified."""
    from transformers import AutoConfig

    from pipeline.dspark.checkpoint import export_checkpoint
    from pipeline.dspark.config import DrafterConfig
    from pipeline.dspark.drafter import DSparkDrafter

    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(target_dir), num_hidden_layers=layers,
                                           draft_vocab_size=draft_vocab, markov_rank=markov_rank)
    d = DSparkDrafter.from_target(cfg, target_dir, draft_ids=torch.arange(draft_vocab))
    with torch.no_grad():
        d.markov_head.markov_w2.weight.normal_(0, 0.02)
        d.confidence_head.proj.weight.normal_(0, 0.5)
    return export_checkpoint(d, out, verifier_name_or_path=str(target_dir))
