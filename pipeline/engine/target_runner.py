"""The target side of speculative decoding, in plain PyTorch (CPU; CUDA when present).

A gpt-fast-style forward for Llama-family HF checkpoints (``llama``, ``qwen2``, ``qwen3``, ``mistral``) with its own
slot-based KV cache:

* a BATCH of requests, each with its own cache length, runs in ONE forward; each request brings its own number of new
  tokens (a prompt to prefill, or ``[anchor, x_1..x_L]`` to verify).  The projections / MLP run on the flattened
  ``[N, d]`` tokens; only attention is padded to ``[R, T_max]`` queries x ``[R, K_max]`` keys with an exact mask
  (causal by absolute position, sliding window where the checkpoint has one);
* KV rollback to the accepted prefix is ``truncate(slot, new_len)`` (O(1): stale entries are masked and overwritten);
* a bf16 runner on CPU keeps its KV cache (and attends) in fp32 where that is faster on the machine
  (``fp32_attention_wins``, measured once per process): PyTorch's CPU flash attention is several times slower in
  bf16 than in fp32 on a CPU without AMX;
* a forward is planned on the host as one ``RaggedBatch`` (token ids, positions, slots, offsets); with a
  ``static_forward`` attached (pipeline/engine/cuda_graphs.py) the batches that fit its buckets run padded to fixed shapes,
  on a GPU as replayed CUDA graphs over the same preallocated cache;
* returns fp32 logits for the requested trailing tokens of every request (the LM head runs in fp32 by default, so the
  acceptance test always sees fp32 probabilities even when the body computes in bf16) and the hidden states of the
  chosen aux layer ids for all new tokens.

Layer-id convention (vLLM ``aux_hidden_state_layer_ids``): id k is the residual stream after k decoder layers; 0 is the
embedding output, id L (= num layers) the last layer's output BEFORE the final norm.  For k < L this is transformers'
``output_hidden_states[k]``.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from pipeline.ops import bf16_linear
from pipeline.ops import packed_linear as pl
from pipeline.ops import small_m_linear as sm
from pipeline.ops.hugepages import arena_copy
from pipeline.engine.kv_cache import PagedKVCache
from pipeline.ops import layer_ops
from pipeline.ops.layers import apply_rope, rms_norm
from pipeline.ops.paged_attention import available as paged_attention_available
from pipeline.ops.paged_attention import paged_attention
from pipeline.ops.paged_attention import unavailable_reason as paged_attention_unavailable_reason
from pipeline.core.runtime import cpu_has_native_bf16

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16 or float32") from None


# CPU linear back ends of fp32 weights: packed (oneDNN layout), mkl (F.linear), hybrid (F.linear for inputs of at
# most HYBRID_FLINEAR_ROWS rows, packed above; both copies kept), tuned (hybrid with the row threshold of each weight
# shape timed on this machine when the runner is built: packed_linear.tune_flinear_rows), smallm (the AVX2 kernel
# of pipeline/ops/small_m_linear.py for inputs of at most small_m_linear.MAX_ROWS rows, packed above; both copies kept)
# invariant (bfloat16:invariant only): bf16 weights through pipeline/ops/bf16_linear.py for every row count, fp32
# residual stream, with the paged KV cache's attention: every row's result is independent of the batch it is in
LINEAR_BACKENDS = ("packed", "mkl", "hybrid", "tuned", "smallm", "invariant")
HYBRID_FLINEAR_ROWS = 2


def parse_precision(spec: str | torch.dtype) -> tuple[torch.dtype, str | None]:
    """``"float32"`` | ``"float32:packed"`` | ``"float32:mkl"`` | ``"float32:hybrid"`` | ``"float32:tuned"`` | ... ->
    (dtype, linear back end).  The suffix picks the CPU linear back end (None = automatic, see TargetRunner)."""
    if isinstance(spec, torch.dtype):
        return spec, None
    name, _, backend = str(spec).partition(":")
    if backend and backend not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear back end {backend!r} in {spec!r}; use one of {list(LINEAR_BACKENDS)}")
    if backend == "invariant" and as_dtype(name) != torch.bfloat16:
        raise ValueError(f"{spec!r}: the invariant back end stores bf16 weights: use bfloat16:invariant")
    return as_dtype(name), (backend or None)


def choose_linear_backend(backend: str | None, dtype: torch.dtype, device: torch.device, hidden_size: int) -> str:
    """The CPU linear back end of a runner: ``backend`` as asked (checked against this machine), or automatic: on CPU
    fp32, ``smallm`` where the small-M kernel beats the packed layout at 1 and 8 rows, else ``hybrid`` where MKL's
    F.linear beats the packed layout at 1 row and ``packed`` where it does not (each measured once per process:
    packed_linear.kernel_wins_few_rows, flinear_wins_one_row); bf16: ``hybrid``; without oneDNN (or on a GPU)
    ``mkl`` (F.linear)."""
    can_pack = device.type == "cpu" and pl.available()
    if backend in ("packed", "hybrid", "tuned", "smallm") and not can_pack:
        raise ValueError(f"the {backend!r} linear back end needs a CPU device and PyTorch built with oneDNN")
    if backend == "invariant" and not bf16_linear.available():
        raise ValueError(f"bfloat16:invariant is unavailable here: {bf16_linear.unavailable_reason()}")
    if backend == "smallm" and not sm.available():
        raise ValueError(f"the 'smallm' linear back end is unavailable here: {sm.unavailable_reason()}")
    if backend == "packed" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        raise ValueError("bfloat16:packed needs a CPU with native bf16 (avx512_bf16 or amx_bf16) and this one "
                         "has none: use float32:packed (or bfloat16, emulated)")
    if backend is None and can_pack:
        if dtype == torch.float32 and pl.kernel_wins_few_rows(hidden_size):
            return "smallm"
        one_row_flinear = dtype != torch.float32 or pl.flinear_wins_one_row(hidden_size)
        return "hybrid" if one_row_flinear else "packed"
    return backend or "mkl"


@dataclass
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qk_norm: bool
    sliding_windows: list  # per layer: None or window size
    max_position_embeddings: int
    eos_token_ids: list = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf_model) -> "TargetConfig":
        """The shapes and switches of a transformers CausalLM (Llama family), checked: ValueError for an
        architecture this runner does not implement."""
        hf_cfg = getattr(hf_model.config, "text_config", None) or hf_model.config
        mt = getattr(hf_cfg, "model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} not supported (supported: {SUPPORTED_MODEL_TYPES})")
        act = getattr(hf_cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} not supported (SwiGLU with silu only)")
        H, KVH = hf_cfg.num_attention_heads, getattr(hf_cfg, "num_key_value_heads", None) or hf_cfg.num_attention_heads
        L = hf_cfg.num_hidden_layers
        sw = getattr(hf_cfg, "sliding_window", None)
        layer_types = getattr(hf_cfg, "layer_types", None)
        if mt == "mistral":
            windows = [sw] * L
        elif layer_types is not None:
            windows = [sw if t == "sliding_attention" else None for t in layer_types]
        else:
            windows = [None] * L
        eos = []
        gen_cfg = getattr(hf_model, "generation_config", None)
        for src in (getattr(gen_cfg, "eos_token_id", None), getattr(hf_cfg, "eos_token_id", None)):
            for e in ([] if src is None else src if isinstance(src, (list, tuple)) else [src]):
                if int(e) not in eos:
                    eos.append(int(e))
        return cls(model_type=mt, vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size, num_layers=L,
                   num_heads=H, num_kv_heads=KVH, head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // H,
                   intermediate_size=hf_cfg.intermediate_size, rms_norm_eps=hf_cfg.rms_norm_eps, qk_norm=(mt == "qwen3"),
                   sliding_windows=windows,
                   max_position_embeddings=getattr(hf_cfg, "max_position_embeddings", 1 << 20), eos_token_ids=eos)


@dataclass
class TargetOutput:
    """Result of one ragged forward.

    logits: fp32 [M, V], the logits rows of every request in order (request r owns rows logit_offsets[r]:[r+1]),
      row i predicts the token AFTER the i-th of that request's returned positions.
    aux_hidden: [N, n_aux * d] (compute dtype) for ALL new tokens, request r owns rows token_offsets[r]:[r+1]; None
      when no aux ids were asked for.
    """

    logits: torch.Tensor
    logit_offsets: list
    aux_hidden: torch.Tensor | None
    token_offsets: list

    def logits_of(self, r: int) -> torch.Tensor:
        return self.logits[self.logit_offsets[r]:self.logit_offsets[r + 1]]

    def aux_of(self, r: int) -> torch.Tensor | None:
        if self.aux_hidden is None:
            return None
        return self.aux_hidden[self.token_offsets[r]:self.token_offsets[r + 1]]


@dataclass
class RaggedBatch:
    """The host-side layout of one ragged forward over R requests with N new tokens in all (``plan_batch``).

    Request r appends num_new[r] tokens to cache slot slots[r] (which holds starts[r] tokens) and gets logits for its
    num_logits[r] trailing ones.  Flat token i (requests in order) is token_ids[i] at absolute position
    positions[i] of slot token_slots[i]; in the [R, T_max] query grid of padded attention it sits at grid_index[i]
    (= r * T_max + t).  Logits row j is the hidden state of flat token logit_rows[j].
    """

    slots: list  # [R] cache slot per request
    starts: list  # [R] cache length before the forward
    num_new: list  # [R] new tokens per request (>= 1)
    num_logits: list  # [R] trailing new tokens that get logits
    token_ids: list  # [N]
    positions: list  # [N] absolute position per token
    token_slots: list  # [N] cache slot per token
    grid_index: list  # [N] row of the [R * T_max] padded query grid per token
    logit_rows: list  # [M] flat token per logits row
    token_offsets: list  # [R + 1] request r owns flat tokens token_offsets[r]:[r+1]
    logit_offsets: list  # [R + 1] request r owns logits rows logit_offsets[r]:[r+1]

    @property
    def num_requests(self) -> int:  # R
        return len(self.slots)

    @property
    def num_tokens(self) -> int:  # N
        return len(self.token_ids)

    @property
    def num_logits_rows(self) -> int:  # M
        return len(self.logit_rows)

    @property
    def max_new(self) -> int:  # T_max
        return max(self.num_new)

    @property
    def ends(self) -> list:  # [R] cache length after the forward
        return [s + n for s, n in zip(self.starts, self.num_new)]

    @property
    def key_len(self) -> int:  # K_max: keys the attention reads per request (the longest end)
        return max(self.ends)

    @property
    def ragged(self) -> bool:  # requests with different numbers of new tokens (the query grid has holes)
        return self.max_new * self.num_requests != self.num_tokens


_FP32_ATTENTION_WINS: dict = {}


def fp32_attention_wins(num_heads: int, num_kv_heads: int, head_dim: int, reps: int = 7) -> bool:
    """Whether attention over an fp32 KV cache beats a bf16 one on this CPU, for a bf16 runner (q cast up, the
    output cast back down): measured once per process and head layout, interleaved, medians, on three shapes a
    decoding engine runs (1 request x 1 token, 8 requests x 1 token, 1 request x 8 tokens; 256 keys).  On some CPUs
    with avx512_bf16 but no AMX PyTorch's CPU flash attention is several times slower in bf16 than in fp32, enough
    to be a large share of a decode step (measurements: docs/results/speed_single_stream.md).  The fp32 cache holds
    the same bf16-rounded keys and values; only the attention's arithmetic is wider."""
    key = (num_heads, num_kv_heads, head_dim)
    if key not in _FP32_ATTENTION_WINS:
        g = torch.Generator().manual_seed(0)
        cases = []
        for R, T, K in ((1, 1, 256), (8, 1, 256), (1, 8, 256)):
            q = torch.randn(R, num_heads, T, head_dim, generator=g).bfloat16()
            k = torch.randn(R, num_kv_heads, K, head_dim, generator=g).bfloat16()
            v = torch.randn(R, num_kv_heads, K, head_dim, generator=g).bfloat16()
            mask = None if R == T == 1 else torch.ones(R, 1, T, K, dtype=torch.bool).tril(K - T)
            cases.append((q, k, v, k.float(), v.float(), mask))
        gqa = num_heads != num_kv_heads

        def run(fp32: bool):
            for q, k, v, k32, v32, mask in cases:
                if fp32:
                    F.scaled_dot_product_attention(q.float(), k32, v32, attn_mask=mask, enable_gqa=gqa).bfloat16()
                else:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

        times = {False: [], True: []}
        for i in range(reps + 1):
            for fp32 in ((False, True) if i % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                run(fp32)
                if i:
                    times[fp32].append(time.perf_counter() - t0)
        _FP32_ATTENTION_WINS[key] = statistics.median(times[True]) < statistics.median(times[False])
    return _FP32_ATTENTION_WINS[key]


KV_LAYOUTS = ("auto", "paged", "dense")
DEFAULT_KV_CACHE_TOKENS = 1 << 16  # the paged cache's default budget: 65,536 token positions over all requests


def auto_precision(device: str | torch.device = "cpu", hidden_size: int = 576) -> str:
    """The precision string of ``--dtype auto`` for this engine: ``bfloat16:invariant`` on a CPU where its kernels
    run (AVX-512: the bf16 linear and the paged attention), else ``float32`` (its linear back end chosen by
    measurement).  Not a timing decision: a micro-benchmark on one cache-resident weight flips with the machine's
    noise, while whole forwards, which stream every weight from memory, favour half the bytes (measurements:
    docs/results/speed_single_stream.md), and every replica of a deployment must resolve alike."""
    if (torch.device(device).type == "cpu" and paged_attention_available()
            and bf16_linear.available() and hidden_size % 16 == 0):
        return "bfloat16:invariant"
    return "float32"


def kv_cache_tokens(target: str | Path, gigabytes: float, bytes_per_value: int = 4) -> int:
    """Token positions a paged KV cache of ``gigabytes`` holds for the HF model at ``target`` (keys and values of
    every layer, ``bytes_per_value`` each: 4 fp32, 2 bf16 -- ``paged_kv_dtype``)."""
    import json

    cfg = json.loads((Path(target) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * bytes_per_value
    return int(gigabytes * (1 << 30) // per_token)


def paged_kv_dtype(precision: str | torch.dtype) -> torch.dtype:
    """The paged KV cache's dtype for a runner of this precision: bf16 for ``bfloat16:invariant`` (its keys and
    values come out of bf16 weights; half the bytes for attention to stream), fp32 otherwise (fp32 stays exact)."""
    return torch.bfloat16 if parse_precision(precision)[1] == "invariant" else torch.float32


def choose_kv_layout(kv_cache: str, device: torch.device, c: TargetConfig, attention_dtype) -> str:
    """"paged" where its attention kernel runs (CPU with AVX-512, head dim 64 or 128, at most 8 query heads per KV
    head, fp32 attention), else "dense"; an explicit "paged" that cannot run is an error naming why."""
    if kv_cache not in KV_LAYOUTS:
        raise ValueError(f"kv_cache must be one of {KV_LAYOUTS}, got {kv_cache!r}")
    if kv_cache == "dense":
        return "dense"
    why = None
    if device.type != "cpu":
        why = f"it runs on the CPU only (this runner is on {device})"
    elif c.head_dim not in (64, 128) or c.num_heads % c.num_kv_heads or c.num_heads // c.num_kv_heads > 8:
        why = f"its kernel takes head dim 64 / 128 and <= 8 heads per KV head (here {c.head_dim}, " \
              f"{c.num_heads} / {c.num_kv_heads})"
    elif attention_dtype is not None and as_dtype(attention_dtype) != torch.float32:
        why = "it attends in fp32"
    elif not paged_attention_available():
        why = f"its kernel is unavailable: {paged_attention_unavailable_reason()}"
    if why is None:
        return "paged"
    if kv_cache == "paged":
        raise ValueError(f"kv_cache='paged' cannot be used: {why}")
    return "dense"


def attention_mask(kidx: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """kidx [K] key positions, qpos [..., T] absolute query positions -> bool [..., T, K]: key j is visible to a query
    at position p iff j <= p (and j > p - window with a sliding window)."""
    m = kidx <= qpos[..., None]
    return m & (kidx > qpos[..., None] - window) if window is not None else m


class _Layer:
    __slots__ = ("ln1", "qkv", "q_norm", "k_norm", "o", "ln2", "gate_up", "down", "window")


class TargetRunner:
    """Llama-family forward with a batched, ragged, roll-back-able KV cache.

    Use: ``slot = runner.alloc()``; ``out = runner.forward([slot, ...], [ids, ...], logits_last=[k, ...],
    aux_layer_ids=[...])``; ``runner.truncate(slot, n)``; ``runner.free(slot)``.
    """

    def __init__(self, hf_model, dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                 fp32_lm_head: bool = True, max_seq_len: int | None = None, init_slots: int = 4,
                 init_len: int = 256, huge_page_arena: bool = False, attention_dtype: str | torch.dtype | None = None,
                 kv_cache: str = "auto", kv_cache_tokens: int | None = None):
        """dtype: a precision string (parse_precision: "float32", "float32:mkl", ...) or a torch dtype; its suffix
        picks the CPU linear back end of fp32 weights (pipeline/ops/packed_linear.py; "bfloat16:packed" packs bf16 weights
        too, on a CPU with native bf16), without one on CPU with oneDNN "hybrid" where MKL's F.linear beats the
        packed layout at 1 row and "packed" where it does not (measured once per process), else F.linear.
        huge_page_arena (CPU, opt-in until it is shown to pay): the plain linear weights live in one block backed by
        transparent huge pages (pipeline/ops/hugepages.py).
        attention_dtype: the KV cache's dtype, in which attention runs (None: ``fp32_attention_wins`` decides for a
        bf16 runner on CPU, else the compute dtype).
        kv_cache: "paged" (pipeline/engine/kv_cache.py: blocks of 16 positions per request, batch-invariant attention
        by pipeline/ops/paged_attention.py; CPU with AVX-512, fp32 attention over an fp32 cache, or a bf16 one for
        ``bfloat16:invariant``: ``paged_kv_dtype``), "dense" (one [slots, max_len] region per
        request, SDPA; the GPU path and CUDA graphs) or "auto" (paged where its kernel runs, else dense).
        kv_cache_tokens: the paged cache's budget in token positions (all requests together; default
        ``DEFAULT_KV_CACHE_TOKENS``)."""
        self.dtype, backend = parse_precision(dtype)
        if backend == "invariant":  # bf16 weights, fp32 residual stream and accumulation
            self.dtype = torch.float32
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.config = TargetConfig.from_hf(hf_model)
        self.hf_config = getattr(hf_model.config, "text_config", None) or hf_model.config
        self.max_seq_len = int(max_seq_len or self.config.max_position_embeddings)
        self.linear_backend = choose_linear_backend(backend, self.dtype, self.device, self.config.hidden_size)
        self.packed_linear = self.linear_backend not in ("mkl", "invariant")
        if self.linear_backend == "invariant" and kv_cache == "dense":
            raise ValueError("bfloat16:invariant attends through the paged KV cache (kv_cache='paged' or 'auto')")
        self._load_weights(hf_model, fp32_lm_head)
        if huge_page_arena and self.device.type == "cpu":  # the streamed matrices in one huge-page-backed block
            plain = [w for w in self.linear_weights() if w.weight is not None]
            for dt_ in {w.weight.dtype for w in plain}:
                group = [w for w in plain if w.weight.dtype == dt_]
                for w, t in zip(group, arena_copy([w.weight for w in group])):
                    w.weight = t
        self._init_rope(hf_model)

        c = self.config
        self.kv_layout = choose_kv_layout("paged" if self.linear_backend == "invariant" else kv_cache, self.device, c,
                                          attention_dtype)
        self.paged: PagedKVCache | None = None
        if self.kv_layout == "paged":
            self.paged = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim,
                                      int(kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS),
                                      dtype=paged_kv_dtype(dtype),
                                      device=self.device)
            attention_dtype = torch.float32
        # the paged forward's norms, RoPE and cache writes through pipeline/ops/layer_ops.py (fp32, no q/k norms)
        self.fused_layer_ops = (self.paged is not None and self.dtype == torch.float32 and not c.qk_norm
                                and self.device.type == "cpu" and layer_ops.usable(c.hidden_size, c.head_dim))
        # dense KV cache: [layers, slots, max_len, kv_heads, head_dim], in the attention dtype
        if attention_dtype is None:
            attention_dtype = torch.float32 if (self.device.type == "cpu" and self.dtype == torch.bfloat16 and
                                                fp32_attention_wins(c.num_heads, c.num_kv_heads, c.head_dim)) \
                else self.dtype
        self.cache_dtype = as_dtype(attention_dtype)
        self._n_slots = 0
        self._cap = 0
        self.k_cache = self.v_cache = None
        if self.paged is None:
            self._ensure(init_slots, min(init_len, self.max_seq_len))
        self.lengths: list[int] = [0] * self._n_slots
        self._free: list[int] = list(range(self._n_slots - 1, -1, -1))
        self._used: set[int] = set()
        self.source: str | None = None  # the HF folder when built by from_pretrained(path)
        # above this many padded attention scores per head (R * T_max * K_max) a ragged batch attends per request
        self.max_padded_scores = 1 << 20
        # a ragged batch mixing requests of more new tokens than this (prompts) with shorter ones (decode and
        # verification blocks) attends per request for the long ones and padded to the short ones' T_max for the
        # rest: padding every one-token row to a prompt's length made such a round cost several decode rounds
        # (measurements: docs/results/load_test.md)
        self.short_block = 16
        # fixed-shape forward for the batches that fit its buckets (pipeline.engine.cuda_graphs.StaticTargetForward;
        # CUDA graphs on a GPU); None = every forward eager
        self.static_forward = None

    def _load_weights(self, hf_model, fp32_lm_head: bool) -> None:
        """The target's weights on the device in the compute dtype; linear layers as PackedWeights of the chosen
        back end (q/k/v fused, gate/up fused), the LM head in fp32 unless told otherwise."""
        dev, dt, backend = self.device, self.dtype, self.linear_backend
        can_pack = dev.type == "cpu" and pl.available()
        flinear_rows = HYBRID_FLINEAR_ROWS if backend in ("hybrid", "tuned") else 0
        kernel_rows = sm.MAX_ROWS if backend == "smallm" and dt == torch.float32 else 0
        # bf16 weights are packed only when asked for ("bfloat16:packed"; choose_linear_backend checked the CPU)
        pack_bf16 = backend == "packed" and dt == torch.bfloat16 and can_pack
        packed_dtypes = {torch.float32, torch.bfloat16} if pack_bf16 else {torch.float32}

        def P(t):  # parameter -> compute dtype on device
            return None if t is None else t.detach().to(device=dev, dtype=dt).contiguous()

        def lin(w, b):
            if backend == "invariant":
                return bf16_linear.InvariantLinear(w.detach().to(dev), None if b is None else b.detach().to(dev))
            w, b = P(w), P(b)
            return pl.PackedWeight(w, b, self.packed_linear and w.dtype in packed_dtypes, flinear_rows, kernel_rows)

        base = hf_model.model if hasattr(hf_model, "model") else hf_model
        self.embed = P(base.embed_tokens.weight)
        self.layers: list[_Layer] = []
        for i, blk in enumerate(base.layers):
            at, mlp = blk.self_attn, blk.mlp
            ly = _Layer()
            ly.ln1 = P(blk.input_layernorm.weight)
            ly.qkv = lin(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight], 0),
                         torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias], 0)
                         if at.q_proj.bias is not None else None)
            ly.q_norm = P(at.q_norm.weight) if self.config.qk_norm else None
            ly.k_norm = P(at.k_norm.weight) if self.config.qk_norm else None
            ly.o = lin(at.o_proj.weight, at.o_proj.bias)
            ly.ln2 = P(blk.post_attention_layernorm.weight)
            ly.gate_up = lin(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0),
                             torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias], 0)
                             if getattr(mlp.gate_proj, "bias", None) is not None else None)
            ly.down = lin(mlp.down_proj.weight, getattr(mlp.down_proj, "bias", None))
            ly.window = self.config.sliding_windows[i]
            self.layers.append(ly)
        self.norm = P(base.norm.weight)
        head = hf_model.lm_head.weight if hasattr(hf_model, "lm_head") else base.embed_tokens.weight
        self.head_dtype = torch.float32 if fp32_lm_head else dt
        if backend == "invariant":
            self.lm_head = bf16_linear.InvariantLinear(head.detach().to(dev), None)
        else:
            head = head.detach().to(device=dev, dtype=self.head_dtype).contiguous()
            self.lm_head = pl.PackedWeight(head, None, self.packed_linear and head.dtype in packed_dtypes,
                                           flinear_rows, kernel_rows)
        self.norm_head = self.norm.to(self.head_dtype)
        # {weight group: F.linear up to this many rows}
        self.flinear_rows = {"all": flinear_rows} if backend == "hybrid" else {}
        if backend == "tuned":
            self.flinear_rows = pl.tune_flinear_rows(self.linear_groups())

    def _init_rope(self, hf_model) -> None:
        """RoPE exactly as transformers: inv_freq + attention_scaling from the HF rotary module (covers rope
        scaling); the cos / sin tables grow on demand (``_rope``)."""
        base = hf_model.model if hasattr(hf_model, "model") else hf_model
        rot = getattr(base, "rotary_emb", None)
        hd = self.config.head_dim
        if rot is not None:
            self._inv_freq = rot.inv_freq.detach().float().to(self.device)
            self._rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        else:
            theta = getattr(self.hf_config, "rope_theta", 10000.0)
            self._inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float, device=self.device) / hd))
            self._rope_scale = 1.0
        self._cos = self._sin = None
        self._rope_len = 0
        self._scale = hd ** -0.5

    # ------------------------------------------------------------------ construction
    def linear_weights(self) -> list:
        """Every linear layer's PackedWeight (layers in order, then the LM head)."""
        return [w for ly in self.layers for w in (ly.qkv, ly.o, ly.gate_up, ly.down)] + [self.lm_head]

    def linear_groups(self) -> dict[str, list]:
        """The PackedWeights by shape: every layer's fused q/k/v, o, fused gate/up, down; the LM head."""
        return {"qkv": [ly.qkv for ly in self.layers], "o": [ly.o for ly in self.layers],
                "gate_up": [ly.gate_up for ly in self.layers], "down": [ly.down for ly in self.layers],
                "lm_head": [self.lm_head]}

    @classmethod
    def from_pretrained(cls, model_or_path, dtype: str | torch.dtype = "float32", device=None, **kw) -> "TargetRunner":
        """From a transformers CausalLM instance or an HF folder (loaded with transformers, then converted)."""
        if isinstance(model_or_path, (str, Path)):
            return cls.several_from_pretrained(model_or_path, [dtype], device=device, **kw)[dtype]
        return cls(model_or_path, dtype=dtype, device=device, **kw)

    @classmethod
    def several_from_pretrained(cls, path, dtypes, device=None, **kw) -> dict[str, "TargetRunner"]:
        """One runner per precision string in `dtypes`, reading the HF folder once per storage dtype
        ("float32" and "float32:mkl" share one load; the runners copy what they keep, so they are independent)."""
        from transformers import AutoModelForCausalLM

        by_load: dict[torch.dtype, list[str]] = {}
        for dt in dict.fromkeys(dtypes):
            by_load.setdefault(parse_precision(dt)[0], []).append(dt)
        runners = {}
        for load_dtype, group in by_load.items():
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=load_dtype)
            for dt in group:
                runners[dt] = cls(m, dtype=dt, device=device, **kw)
                runners[dt].source = str(path)
            del m
        return runners

    # ------------------------------------------------------------------ cache management
    def _ensure(self, n_slots: int, length: int) -> None:
        if length > self.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds max_seq_len {self.max_seq_len}")
        if n_slots <= self._n_slots and length <= self._cap:
            return
        new_slots = max(n_slots, self._n_slots)
        if n_slots > self._n_slots:
            new_slots = max(n_slots, 2 * self._n_slots)
        new_cap = self._cap
        if length > self._cap:
            new_cap = min(self.max_seq_len, max(length, 2 * self._cap))
        c = self.config
        shape = (c.num_layers, new_slots, new_cap, c.num_kv_heads, c.head_dim)
        k = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        if self.k_cache is not None:
            k[:, :self._n_slots, :self._cap] = self.k_cache
            v[:, :self._n_slots, :self._cap] = self.v_cache
        if hasattr(self, "lengths"):
            self.lengths.extend([0] * (new_slots - self._n_slots))
            self._free = list(range(new_slots - 1, self._n_slots - 1, -1)) + self._free
        self.k_cache, self.v_cache = k, v
        self._n_slots, self._cap = new_slots, new_cap

    def alloc(self) -> int:
        """A fresh, empty cache slot.  Dense layout: the lowest free one, so the slots in use stay packed at the bottom of the cache
        and a batch over them in slot order reads its K/V as one view (a batch over scattered slots gathers a copy
        of every layer's K/V, which slows a many-request decode step; measurements: docs/results/load_test.md)."""
        if self.paged is not None:
            s = self.paged.alloc()
            self._used.add(s)
            return s
        if not self._free:
            self._ensure(self._n_slots + 1, self._cap)
        s = min(self._free)
        self._free.remove(s)
        self.lengths[s] = 0
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        if self.paged is not None and slot in self._used:
            self._used.remove(slot)
            self.paged.free(slot)
        elif slot in self._used:
            self._used.remove(slot)
            self.lengths[slot] = 0
            self._free.append(slot)

    def length(self, slot: int) -> int:
        return self.paged.length(slot) if self.paged is not None else self.lengths[slot]

    def truncate(self, slot: int, new_len: int) -> None:
        """Roll the slot's KV cache back to its first ``new_len`` tokens (paged: whole blocks past them are freed)."""
        if self.paged is not None:
            return self.paged.truncate(slot, new_len)
        if not 0 <= new_len <= self.lengths[slot]:
            raise ValueError(f"truncate slot {slot} to {new_len}: cache holds {self.lengths[slot]}")
        self.lengths[slot] = new_len

    def _rope(self, n: int):
        if n > self._rope_len:
            n = max(n, min(self.max_seq_len, 2 * self._rope_len, 1 << 20), 256)
            pos = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), -1)
            self._cos = (emb.cos() * self._rope_scale).to(self.dtype)
            self._sin = (emb.sin() * self._rope_scale).to(self.dtype)
            self._rope_len = n
        return self._cos, self._sin

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, slots: Sequence[int], input_ids: Sequence, logits_last: Sequence[int] | int | None = None,
                aux_layer_ids: Sequence[int] = (), commit: bool = True) -> TargetOutput:
        """Append ``input_ids[r]`` (list/1-D tensor, >= 1 token) to slot ``slots[r]`` for every r, in ONE forward.

        logits_last: per request, how many trailing new tokens get logits (None = all of them, int = same for all,
          0 = none).  Prefill wants 1, verification of [anchor, x_1..x_L] wants L+1.
        aux_layer_ids: vLLM-convention layer ids whose hidden states are returned for all new tokens, concatenated
          in the given order along the feature axis.
        commit: False leaves the cache lengths unchanged (a pure scoring forward; the written K/V are then stale).

        Phases: plan the ragged batch on the host (``plan_batch``), make room in the cache, run the layers (eagerly,
        or through ``static_forward`` -- fixed-shape buckets, CUDA graphs on a GPU -- when one is attached and the
        batch fits its buckets), then commit the new cache lengths.
        """
        batch = self.plan_batch(slots, input_ids, logits_last)
        aux_ids = self._check_aux_ids(aux_layer_ids)
        if batch.key_len > self.max_seq_len:
            raise ValueError(f"sequence length {batch.key_len} exceeds max_seq_len {self.max_seq_len}")
        if self.paged is not None:
            for s, e in zip(batch.slots, batch.ends):
                self.paged.grow(s, e)  # CacheFull names what did not fit
            out = self._forward_paged(batch, aux_ids)
            if commit:
                for s, e in zip(batch.slots, batch.ends):
                    self.paged.commit(s, e)
            return out
        self._ensure(max(batch.slots) + 1, batch.key_len)
        static = self.static_forward
        if static is not None and static.fits(batch):
            out = static(batch, aux_ids)
        else:
            out = self._forward_eager(batch, aux_ids)
        if commit:
            for s, e in zip(batch.slots, batch.ends):
                self.lengths[s] = e
        return out

    def plan_batch(self, slots: Sequence[int], input_ids: Sequence,
                   logits_last: Sequence[int] | int | None = None) -> RaggedBatch:
        """The host-side layout of one ragged forward (checks the request list; touches no tensor on the device)."""
        slots = [int(x) for x in slots]
        R = len(slots)
        if R == 0:
            raise ValueError("empty batch")
        ids_l = [x.tolist() if isinstance(x, torch.Tensor) else list(x) for x in input_ids]
        if len(ids_l) != R:
            raise ValueError(f"{len(ids_l)} token lists for {R} slots")
        ns = [len(x) for x in ids_l]
        if min(ns) < 1:
            raise ValueError("every request needs at least one new token")
        if len(set(slots)) != R:
            raise ValueError("a slot appears twice in one batch")
        if min(slots) < 0:
            raise ValueError(f"negative slot in {slots}")
        if self.paged is not None:
            unknown = [s for s in slots if s not in self._used]
            if unknown:
                raise ValueError(f"slots {unknown} are not allocated")
            starts = [self.paged.length(s) for s in slots]
        else:
            starts = [self.lengths[s] if s < len(self.lengths) else 0 for s in slots]
        if logits_last is None:
            nl = ns
        elif isinstance(logits_last, int):
            nl = [min(logits_last, n) for n in ns]
        else:
            nl = [min(int(k), n) for k, n in zip(logits_last, ns)]
        T = max(ns)
        # index bookkeeping in Python lists (moved to the device in one transfer by the forward)
        flat_ids, pos, slot_of, pad_idx, out_rows = [], [], [], [], []
        tok_off, log_off = [0], [0]
        o = 0
        for r in range(R):
            n, st, s = ns[r], starts[r], slots[r]
            flat_ids.extend(ids_l[r])
            pos.extend(range(st, st + n))
            slot_of.extend([s] * n)
            pad_idx.extend(range(r * T, r * T + n))
            out_rows.extend(range(o + n - nl[r], o + n))
            o += n
            tok_off.append(o)
            log_off.append(log_off[-1] + nl[r])
        return RaggedBatch(slots=slots, starts=starts, num_new=ns, num_logits=nl, token_ids=flat_ids, positions=pos,
                           token_slots=slot_of, grid_index=pad_idx, logit_rows=out_rows, token_offsets=tok_off,
                           logit_offsets=log_off)

    def _check_aux_ids(self, aux_layer_ids: Sequence[int]) -> list:
        aux_ids = list(aux_layer_ids)
        for a in aux_ids:
            if not 0 <= a <= self.config.num_layers:
                raise ValueError(f"aux layer id {a} outside [0, {self.config.num_layers}]")
        return aux_ids

    def _forward_paged(self, batch: RaggedBatch, aux_ids: list) -> TargetOutput:
        """The layers over the flattened [N, d] tokens; every token's K/V written into its cache block, every token
        attending over its own request's blocks (pipeline/ops/paged_attention.py: no padding, and each row reduced
        in a fixed order whatever else is in the batch)."""
        c, dev, cache = self.config, self.device, self.paged
        N, M = batch.num_tokens, batch.num_logits_rows
        cos_t, sin_t = self._rope(batch.key_len)
        meta = torch.tensor(batch.token_ids + batch.positions + batch.logit_rows, dtype=torch.long).to(dev)
        ids_t, pos_t, rows_t = meta[:N], meta[N:2 * N], meta[2 * N:]
        blocks_t, offsets_t = (t.to(dev) for t in cache.locate(batch.token_slots, batch.positions))
        tables_t = cache.table_tensor(batch.slots).to(dev)  # [R, W] block tables, rows in batch order
        row_req_t = torch.repeat_interleave(torch.arange(batch.num_requests), torch.tensor(batch.num_new)).to(dev)
        H, hd = c.num_heads, c.head_dim
        x, cos, sin, aux_out = self._embed_tokens(ids_t, pos_t, cos_t, sin_t, aux_ids)
        if self.fused_layer_ops:  # the glue between the matrix products in four kernel calls a layer
            eps, L = c.rms_norm_eps, len(self.layers)
            cos, sin = cos.view(N, hd), sin.view(N, hd)
            h = layer_ops.rms_norm(x, self.layers[0].ln1, eps)
            for li, ly in enumerate(self.layers):
                q = layer_ops.rope_write_kv(ly.qkv(h), cos, sin, cache.k[li], cache.v[li], blocks_t, offsets_t, H)
                att = paged_attention(q, cache.k[li], cache.v[li], tables_t, row_req_t, pos_t, self._scale,
                                      self._layer_window(ly, batch.key_len))
                x, h = layer_ops.add_rms_norm(x, ly.o(att.view(N, H * hd)), ly.ln2, eps)
                mlp = self._swiglu(ly, h)
                if li + 1 < L:
                    x, h = layer_ops.add_rms_norm(x, mlp, self.layers[li + 1].ln1, eps)
                else:
                    x = x + mlp
                if (li + 1) in aux_ids:
                    aux_out[li + 1] = x
        else:
            for li, ly in enumerate(self.layers):
                q, k, v = self._qkv(ly, x, cos, sin)  # [N, H, hd], [N, KVH, hd] x2, fp32
                cache.write(li, blocks_t, offsets_t, k, v)
                att = paged_attention(q, cache.k[li], cache.v[li], tables_t, row_req_t, pos_t, self._scale,
                                      self._layer_window(ly, batch.key_len))
                x = self._mlp_block(ly, x, att.view(N, H * hd))
                if (li + 1) in aux_ids:
                    aux_out[li + 1] = x
        if M:
            hl = x if (M == N and batch.logit_rows == list(range(N))) else x[rows_t]
            logits = self._logits(hl)
        else:
            logits = x.new_zeros(0, c.vocab_size, dtype=torch.float32)
        aux = torch.cat([aux_out[a] for a in aux_ids], -1) if aux_ids else None
        return TargetOutput(logits=logits, logit_offsets=batch.logit_offsets, aux_hidden=aux,
                            token_offsets=batch.token_offsets)

    def _forward_eager(self, batch: RaggedBatch, aux_ids: list) -> TargetOutput:
        """The layers over the flattened [N, d] tokens; attention padded to [R, T_max] x [R, K_max] (or per request)."""
        c = self.config
        dev = self.device
        slots, starts, ns, ends = batch.slots, batch.starts, batch.num_new, batch.ends
        R, N, M, Tmax, Kmax = batch.num_requests, batch.num_tokens, batch.num_logits_rows, batch.max_new, \
            batch.key_len
        tok_off = batch.token_offsets
        ragged = batch.ragged
        cos_t, sin_t = self._rope(Kmax)
        meta = torch.tensor(batch.token_ids + batch.positions + batch.token_slots +
                            (batch.grid_index if ragged else []) + batch.logit_rows,
                            dtype=torch.long).to(dev, non_blocking=True)
        ids_t, pos_t, slot_t = meta[:N], meta[N:2 * N], meta[2 * N:3 * N]
        rest = meta[3 * N:]
        pad_t = rest[:N] if ragged else None  # [N] row of each token in the [R * T_max] query grid
        rows_t = rest[N:] if ragged else rest  # [M] token of each logits row

        # Attention layout.  'padded': one SDPA over [R, Tmax] queries x [R, Kmax] keys with an exact mask (decode /
        # verification batches).  'per_request': one SDPA per request (no padding) when padding would be large.
        # 'mixed': a prompt prefilled together with short decode / verification blocks -- the long rows one SDPA
        # each, the short ones padded together to their own T_max (never to the prompt's length).
        long_rows = [r for r in range(R) if ns[r] > self.short_block] if R > 1 and ragged else []
        if R > 1 and ragged and R * Tmax * Kmax > self.max_padded_scores:
            pad_rows, long_rows = [], list(range(R))
        elif long_rows and len(long_rows) < R:
            pad_rows = [r for r in range(R) if ns[r] <= self.short_block]
        else:
            pad_rows, long_rows = list(range(R)), []
        windows = {self._layer_window(ly, Kmax) for ly in self.layers}
        masks = {}  # window -> the padded rows' mask [R_p, 1, T_p, K_p] (or None)
        long_masks = {w: [] for w in windows}  # window -> one mask (or None) per long row
        if pad_rows:
            Tp = max(ns[r] for r in pad_rows)
            Kp = max(ends[r] for r in pad_rows)
            kidx = torch.arange(Kp, device=dev)
            # key j visible to query t of request r iff j <= start_r + t (padded queries t >= n_r reuse the last real
            # position: always >= 1 visible key; their outputs are dropped)
            need_mask = not (len(pad_rows) == 1 and Tp == 1)
            qpos = torch.tensor([[starts[r] + min(t, ns[r] - 1) for t in range(Tp)] for r in pad_rows],
                                dtype=torch.long).to(dev, non_blocking=True)  # [R_p, T_p]
            masks = {w: (attention_mask(kidx, qpos, w).unsqueeze(1) if (need_mask or w is not None) else None)
                     for w in windows}
        if long_rows:
            kidx_l = torch.arange(max(ends[r] for r in long_rows), device=dev)
            for w in windows:
                for r in long_rows:
                    st, n = starts[r], ns[r]
                    long_masks[w].append(None if n == 1 and w is None else  # one query sees the whole cache
                                         attention_mask(kidx_l, torch.arange(st, st + n, device=dev), w)
                                         [None, None, :, :st + n])
        layer_windows = [self._layer_window(ly, Kmax) for ly in self.layers]
        sub = bool(pad_rows) and len(pad_rows) < R  # the padded rows are a subset: gather / scatter their tokens
        if sub:
            tok_p, grid_p = [], []
            for i, r in enumerate(pad_rows):
                tok_p.extend(range(tok_off[r], tok_off[r + 1]))
                grid_p.extend(range(i * Tp, i * Tp + ns[r]))
            idx = torch.tensor(tok_p + grid_p, dtype=torch.long).to(dev, non_blocking=True)
            tok_p_t, grid_p_t = idx[:len(tok_p)], idx[len(tok_p):]
        elif pad_rows:
            tok_p_t, grid_p_t = None, pad_t  # all rows: the batch's own token -> query-grid map
        pad_slots = [slots[r] for r in pad_rows]
        pad_contiguous = bool(pad_rows) and pad_slots == list(range(pad_slots[0], pad_slots[0] + len(pad_rows)))
        pad_sel = None if (not pad_rows or pad_contiguous) else torch.tensor(pad_slots, dtype=torch.long, device=dev)
        pad_ragged = bool(pad_rows) and any(ns[r] != Tp for r in pad_rows)  # holes in the padded query grid

        H, KVH, hd = c.num_heads, c.num_kv_heads, c.head_dim
        x, cos, sin, aux_out = self._embed_tokens(ids_t, pos_t, cos_t, sin_t, aux_ids)
        gqa = H != KVH
        Rp = len(pad_rows)
        for li, ly in enumerate(self.layers):
            q, k, v = self._qkv(ly, x, cos, sin)  # [N, H, hd], [N, KVH, hd] x2, in the cache dtype
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc[slot_t, pos_t] = k
            vc[slot_t, pos_t] = v
            w = layer_windows[li]
            att = None if not sub and not long_rows else q.new_empty(N, H * hd)
            for j, r in enumerate(long_rows):
                a, b, e, sl = tok_off[r], tok_off[r + 1], ends[r], slots[r]
                o_r = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], kc[sl, :e].transpose(0, 1)[None],
                    vc[sl, :e].transpose(0, 1)[None], attn_mask=long_masks[w][j], scale=self._scale,
                    enable_gqa=gqa)
                att[a:b] = o_r[0].transpose(0, 1).reshape(b - a, H * hd)
            if Rp:
                if pad_sel is None:
                    K = kc[pad_slots[0]:pad_slots[0] + Rp, :Kp]  # [R_p, K_p, KVH, hd]
                    V = vc[pad_slots[0]:pad_slots[0] + Rp, :Kp]
                else:
                    K = kc[pad_sel, :Kp]
                    V = vc[pad_sel, :Kp]
                qs = q if tok_p_t is None else q[tok_p_t]
                if pad_ragged:
                    qp = q.new_zeros(Rp * Tp, H, hd)
                    qp[grid_p_t] = qs
                    qp = qp.view(Rp, Tp, H, hd)
                else:
                    qp = qs.view(Rp, Tp, H, hd)
                o_p = F.scaled_dot_product_attention(qp.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2),
                                                     attn_mask=masks[w], scale=self._scale, enable_gqa=gqa)
                o_p = o_p.transpose(1, 2).reshape(Rp * Tp, H * hd)
                if pad_ragged:
                    o_p = o_p[grid_p_t]
                if att is None:
                    att = o_p
                else:
                    att[tok_p_t] = o_p
            x = self._mlp_block(ly, x, att)
            if (li + 1) in aux_ids:
                aux_out[li + 1] = x

        if M:
            hl = x if (M == N and not ragged and batch.logit_rows == list(range(N))) else x[rows_t]
            logits = self._logits(hl)
        else:
            logits = x.new_zeros(0, c.vocab_size, dtype=torch.float32)
        aux = torch.cat([aux_out[a] for a in aux_ids], -1) if aux_ids else None
        return TargetOutput(logits=logits, logit_offsets=batch.logit_offsets, aux_hidden=aux,
                            token_offsets=tok_off)

    # pieces of a decoder layer shared by the eager and the fixed-shape forward (pipeline/engine/cuda_graphs.py)
    @staticmethod
    def _layer_window(ly: _Layer, key_len: int):
        """The layer's sliding window, or None where it does not cut the keys [0, key_len)."""
        return None if (ly.window is None or key_len <= ly.window) else ly.window

    def _embed_tokens(self, ids: torch.Tensor, pos: torch.Tensor, cos_t, sin_t, aux_ids):
        """ids / pos [N] -> (x [N, d], cos / sin [N, 1, hd] at the positions, {0: x} when layer 0 is captured)."""
        x = self.embed[ids]
        return x, cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1), ({0: x} if 0 in aux_ids else {})

    def _qkv(self, ly: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, d] -> q [N, H, hd], k / v [N, KVH, hd] (q/k normed where the model has it, RoPE applied), in the
        KV cache's dtype: attention runs in it (fp32 for a bf16 runner on a CPU where bf16 attention is slow)."""
        c = self.config
        H, KVH, hd, N = c.num_heads, c.num_kv_heads, c.head_dim, x.shape[0]
        h = rms_norm(x, ly.ln1, c.rms_norm_eps)
        qkv = ly.qkv(h)
        q = qkv[:, :H * hd].view(N, H, hd)
        k = qkv[:, H * hd:(H + KVH) * hd].view(N, KVH, hd)
        v = qkv[:, (H + KVH) * hd:].view(N, KVH, hd)
        if ly.q_norm is not None:
            q = rms_norm(q, ly.q_norm, c.rms_norm_eps)
            k = rms_norm(k, ly.k_norm, c.rms_norm_eps)
        adt = self.cache_dtype
        return apply_rope(q, cos, sin).to(adt), apply_rope(k, cos, sin).to(adt), v.to(adt)

    def _mlp_block(self, ly: _Layer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual stream after the attention output ``att`` [N, H*hd] (in the cache dtype) and the SwiGLU MLP:
        [N, d]."""
        x = x + ly.o(att.to(x.dtype))
        return x + self._swiglu(ly, rms_norm(x, ly.ln2, self.config.rms_norm_eps))

    @staticmethod
    def _swiglu(ly: _Layer, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of normed rows h [N, d] -> [N, d]."""
        gu = ly.gate_up(h)
        I = gu.shape[-1] // 2
        return ly.down(F.silu(gu[:, :I]) * gu[:, I:])

    def _logits(self, hl: torch.Tensor) -> torch.Tensor:
        """Residual stream rows [M, d] -> fp32 logits [M, V] (final norm + LM head in the head dtype)."""
        eps = self.config.rms_norm_eps
        hl = rms_norm(hl.to(self.head_dtype), self.norm_head, eps) if self.head_dtype != self.dtype else \
            rms_norm(hl, self.norm, eps)
        return self.lm_head(hl).float()

    __call__ = forward

    # ------------------------------------------------------------------ conveniences
    def prefill(self, slot: int, ids, aux_layer_ids: Sequence[int] = ()) -> TargetOutput:
        return self.forward([slot], [ids], logits_last=1, aux_layer_ids=aux_layer_ids)

    def time_forwards(self, token_counts: Sequence[int], context_len: int = 300, max_tokens_per_request: int = 8,
                      repeats: int = 5, warmup: int = 2) -> dict:
        """{B: median seconds} for several B, measured in interleaved sweeps (every B once per sweep, ``warmup``
        sweeps discarded), so a burst of contention on a shared machine hits all B alike instead of one B's block."""
        counts = sorted({int(b) for b in token_counts})
        if not counts or counts[0] < 1:
            raise ValueError(f"token counts must be >= 1, got {token_counts}")
        split = {}
        for b in counts:
            nreq = max(1, math.ceil(b / max_tokens_per_request))
            split[b] = [b // nreq + (1 if i < b % nreq else 0) for i in range(nreq)]
        slots = [self.alloc() for _ in range(max(len(p) for p in split.values()))]
        g = torch.Generator().manual_seed(0)
        times: dict = {b: [] for b in counts}
        try:
            for s in slots:
                ctx = torch.randint(0, self.config.vocab_size, (context_len,), generator=g)
                self.forward([s], [ctx], logits_last=0)
            for i in range(warmup + repeats):
                for b in counts:
                    per = split[b]
                    batch = [torch.randint(0, self.config.vocab_size, (p,), generator=g) for p in per]
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    self.forward(slots[:len(per)], batch)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    for s in slots[:len(per)]:
                        self.truncate(s, context_len)
                    if i >= warmup:
                        times[b].append(dt)
            return {b: sorted(ts)[len(ts) // 2] for b, ts in times.items()}
        finally:
            for s in slots:
                self.free(s)
