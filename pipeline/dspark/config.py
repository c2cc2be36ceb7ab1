"""DrafterConfig: every shape and switch of a DSpark / DFlash drafter (docs/dspark.md §1-§4).

Layer-id convention (project-wide, vLLM's `aux_hidden_state_layer_ids`): id k is the target's residual stream after
k decoder layers -- 0 = embedding output, L = output of the last layer BEFORE the final norm.  DeepSpec's ids are
0-based layer indices (theirs i == ours i+1); `dflash_layer_ids` converts once, here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DRAFTER_KINDS = ("dspark", "dflash")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
MARKOV_W1_SOURCES = ("table", "embedding")


class DrafterConfigError(ValueError):
    pass


def dflash_layer_ids(num_target_layers: int, n: int = 3) -> list[int]:
    """The DFlash rule for n aux layers, in OUR convention (id k = residual after k layers).

    DeepSpec: theirs_i = round(1 + i*(L-4)/(n-1)), 0-based layer indices spread evenly from layer 1 to L-3;
    ours = theirs + 1, i.e. from 2 to L-2.  For tiny targets where that range has < n distinct ids, fall back to
    ids spread evenly over [1, L-1], then over [0, L].
    """
    L = int(num_target_layers)
    if n < 1:
        raise DrafterConfigError(f"need at least one aux layer, got n={n}")
    if n > L + 1:
        raise DrafterConfigError(f"cannot pick {n} distinct aux layer ids from a {L}-layer target (ids 0..{L})")
    if n == 1:
        return [max(1, min(L, L // 2))]
    ids = [int(round(1 + i * (L - 4) / (n - 1))) + 1 for i in range(n)] if L >= 4 else []
    if len(ids) == n and all(a < b for a, b in zip(ids, ids[1:])) and ids[0] >= 0 and ids[-1] <= L:
        return ids
    for lo, hi in ((1, L - 1), (0, L)):
        if hi - lo + 1 >= n:
            ids = [int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n)]
            if all(a < b for a, b in zip(ids, ids[1:])):
                return ids
    return list(range(n))  # n <= L+1 guarantees this is valid


def parse_layer_ids(spec: str | list | None, n_layers: int, n_default: int = 3) -> list[int]:
    """``--layer-ids`` ("2,15,28", a list, or empty for DFlash's rule) -> strictly increasing ids in [0, n_layers]."""
    if spec is None or spec == "" or spec == []:
        return dflash_layer_ids(n_layers, n_default)
    ids = [int(x) for x in (spec.split(",") if isinstance(spec, str) else spec)]
    if sorted(set(ids)) != ids:
        raise ValueError(f"layer ids must be strictly increasing, got {ids}")
    if ids[0] < 0 or ids[-1] > n_layers:
        raise ValueError(f"layer ids must lie in [0, {n_layers}] for a {n_layers}-layer target, got {ids}")
    return ids


@dataclass
class DrafterConfig:
    # --- backbone (Qwen3-style layer; draft hidden == target hidden) -------------------------------------------
    hidden_size: int  # d
    num_attention_heads: int  # H
    num_key_value_heads: int  # K (GQA)
    head_dim: int  # h
    intermediate_size: int  # I (SwiGLU)
    vocab_size: int  # V, target vocab (rows of embed_tokens and markov_w1)
    mask_token_id: int  # embedded (frozen) into block slots 1..γ-1
    aux_layer_ids: list[int]  # vLLM convention, strictly increasing; fc input = len * d
    num_hidden_layers: int = 2  # draft layers, 1..5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    draft_vocab_size: int | None = None  # V_d; None or == V -> full vocabulary
    block_size: int = 7  # γ: slot k-1 predicts x_k, k = 1..γ
    # --- sequential stage / confidence (docs/dspark.md §3-§4) --------------------------------------------------------
    kind: str = "dspark"  # 'dspark' | 'dflash'
    markov_rank: int = 256  # r; 0 = no Markov head (DFlash)
    markov_head_type: str = "vanilla"  # 'vanilla' | 'gated' | 'rnn'
    # training-time parameterisation of W1 (pipeline/dspark/markov_head.py): 'table' | 'embedding'; never exported (the
    # checkpoint holds the materialised table, so a loaded drafter is always 'table')
    markov_w1_source: str = "table"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sts_temperatures: list[float] | None = None  # one per position (STS, §4); None = raw confidences
    # --- bookkeeping ---------------------------------------------------------------------------------------------
    target_num_layers: int | None = None  # L of the target (for validating aux ids); None = unchecked
    context_window: int | None = None  # attend only to the last W context tokens (both paths); None = all
    hidden_act: str = "silu"
    attention_bias: bool = False
    extra: dict = field(default_factory=dict)  # free-form metadata (e.g. target name); round-trips via checkpoint

    def __post_init__(self):
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.sts_temperatures is not None:
            self.sts_temperatures = [float(t) for t in self.sts_temperatures]
        self.validate()

    # --- derived -------------------------------------------------------------------------------------------------
    @property
    def num_aux_layers(self) -> int:  # n
        return len(self.aux_layer_ids)

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.vocab_size

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    def validate(self) -> None:
        def bad(msg):
            raise DrafterConfigError(f"DrafterConfig: {msg}")

        if self.kind not in DRAFTER_KINDS:
            bad(f"kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "block_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                bad(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.num_hidden_layers <= 5:
            bad(f"num_hidden_layers must be in 1..5, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            bad(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            bad(f"draft_vocab_size must be in 1..vocab_size={self.vocab_size}, got {self.draft_vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            bad(f"mask_token_id must be a target token id < {self.vocab_size}, got {self.mask_token_id}")
        ids = self.aux_layer_ids
        if not ids:
            bad("aux_layer_ids is empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            bad(f"aux_layer_ids must be strictly increasing, got {ids}")
        if ids[0] < 0:
            bad(f"aux_layer_ids must be >= 0 (0 = embedding output), got {ids}")
        if self.target_num_layers is not None and ids[-1] > self.target_num_layers:
            bad(f"aux_layer_ids {ids} exceed the target's {self.target_num_layers} layers (vLLM convention: id k = "
                f"residual after k layers, max id = L = {self.target_num_layers})")
        if self.markov_rank < 0:
            bad(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_w1_source not in MARKOV_W1_SOURCES:
            bad(f"markov_w1_source must be one of {MARKOV_W1_SOURCES}, got {self.markov_w1_source!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            bad(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}")
        if self.kind == "dflash" and (self.markov_rank != 0 or self.enable_confidence_head):
            bad("kind='dflash' means no Markov head and no confidence head: set markov_rank=0, "
                "enable_confidence_head=False (from_target_config(kind='dflash') does)")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            bad("confidence_head_with_markov=True needs markov_rank > 0")
        if self.sts_temperatures is not None:
            if len(self.sts_temperatures) != self.block_size:
                bad(f"sts_temperatures needs {self.block_size} values (one per position), "
                    f"got {len(self.sts_temperatures)}")
            if any(not t > 0 for t in self.sts_temperatures):
                bad(f"sts_temperatures must be > 0, got {self.sts_temperatures}")
        if self.context_window is not None and self.context_window <= 0:
            bad(f"context_window must be > 0 or None, got {self.context_window}")
        if self.hidden_act != "silu":
            bad(f"only hidden_act='silu' (SwiGLU) is supported, got {self.hidden_act!r}")

    # --- (de)serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise DrafterConfigError(f"DrafterConfig: unknown fields {sorted(unknown)}")
        return cls(**d)

    def replace(self, **kw) -> "DrafterConfig":
        return dataclasses.replace(self, **kw)

    # --- construction from a target ------------------------------------------------------------------------------
    @classmethod
    def from_target_config(cls, hf_config, *, num_hidden_layers: int = 2, aux_layer_ids: list[int] | None = None,
                           num_aux_layers: int = 3, mask_token_id: int | None = None,
                           draft_vocab_size: int | None = None, kind: str = "dspark", **overrides) -> "DrafterConfig":
        """Copy widths from a HF target config (Llama / Qwen2 / Qwen3 ...): d, heads, head_dim, MLP, RoPE theta.

        aux ids default to the DFlash rule with `num_aux_layers` (3: fine for small targets; DeepSpec uses 5).
        mask_token_id defaults to the config's pad token, else its (first) eos token.
        """
        c = hf_config
        L = int(c.num_hidden_layers)
        heads = int(c.num_attention_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if aux_layer_ids is None:
            aux_layer_ids = dflash_layer_ids(L, num_aux_layers)
        if mask_token_id is None:
            for cand in (getattr(c, "pad_token_id", None), getattr(c, "eos_token_id", None)):
                if isinstance(cand, (list, tuple)):
                    cand = cand[0] if cand else None
                if cand is not None:
                    mask_token_id = int(cand)
                    break
            else:
                raise DrafterConfigError("target config has neither pad_token_id nor eos_token_id: pass mask_token_id")
        kw = dict(
            hidden_size=int(c.hidden_size), num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
            intermediate_size=int(c.intermediate_size), vocab_size=int(c.vocab_size), mask_token_id=mask_token_id,
            aux_layer_ids=list(aux_layer_ids), num_hidden_layers=num_hidden_layers,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=_rope_theta(c),
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 32768)),
            draft_vocab_size=draft_vocab_size, target_num_layers=L, kind=kind,
        )
        if kind == "dflash":
            kw.update(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
        kw.update(overrides)
        return cls(**kw)


def _rope_theta(c) -> float:
    theta = getattr(c, "rope_theta", None)
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    # the drafter has its own positions and always uses plain (unscaled) neox RoPE with the target's theta
    return float(theta if theta is not None else 10000.0)
