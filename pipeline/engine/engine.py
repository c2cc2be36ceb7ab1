"""SpeculativeEngine: batched speculative decoding with a DSpark / DFlash drafter (or none) over a TargetRunner.

One ``step()`` = one round for every active request:
  1. new requests are prefilled (their first token is sampled from the target, docs/dspark.md §6.1) -- in the same target
     forward as the others' verification; with ``max_num_batched_tokens`` a round takes at most that many target
     tokens: the decoding requests' anchors first, then prompts in chunks (a long prompt over several rounds, so the
     others keep decoding), then verified drafts in what is left;
  2. the drafter proposes γ drafts for every decoding request from its anchor (the last emitted token, the only
     emitted token not yet in the target's KV cache);
  3. the scheduler picks a depth L_r per request (capped by the remaining token budget and the cache);
  4. ONE target forward scores [x_0, x_1..x_{L_r}] for all requests (ragged);
  5. the rejection sampler accepts m_r drafts and emits one target token (residual or bonus);
  6. caches roll back to the accepted prefix (target: n + m + 1 tokens; the drafter gets the aux hidden states of
     [x_0..x_m] at positions n..n+m), tokens are appended with stop handling (EOS ids, stop strings, max_tokens --
     nothing past a stop is ever emitted, accepted drafts after an EOS are discarded).
Requests may join (``add_request``) or leave (``abort``) between steps.  With a paged KV cache (pipeline/engine/kv_cache.py)
a request is admitted when the cache can hold it at its full length (prompt + completion + a verification block);
until then it waits, first come first served (``queue_position``), so a running request never runs out of cache.  Without a drafter the same loop is the
plain autoregressive baseline (depth 0, one token per request per forward).  In code the round is four phases over
one ``RoundBatch``: ``_plan_depths`` (2-3), ``_run_target`` (1, 4), ``_verify`` (5), ``_commit`` (6).

``SpecConfig(cuda_graphs=True)`` (CUDA targets only) pads every round that fits the buckets of
pipeline.engine.cuda_graphs.StaticShapes to fixed shapes and replays one CUDA graph per bucket for the target forward and,
with a DSparkDrafter, for the drafting round; the outputs are the unpadded ones (tests/test_cuda_graphs.py).

Drafter contract (pipeline/dspark/drafter.py): ``new_state()``, ``extend_context(state, aux_hidden [n, n_aux*d],
start_pos)``, ``propose(states, anchors LongTensor[B], params, generator) -> DraftProposal(tokens [B, γ] target ids,
q [B, γ, V_d] fp32, conf_logits [B, γ] | None, draft_ids [V_d])``, ``config`` (or nn.Module ``cfg``) with
``block_size`` and ``aux_layer_ids``; optional ``extend_contexts`` (batched) and ``free_state(state)``.
Requests are grouped by draft SamplingParams for ``propose``; a seeded request is proposed alone with its own
generator so its output does not depend on the batch.  Not thread-safe: drive it from one thread (or one actor).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from pipeline.engine.cuda_graphs import StaticDraftProposer, StaticShapes, StaticTargetForward
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.engine.rejection_sampler import RejectionSampler, VerifyResult
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.cost_table import CostTable
from pipeline.engine.scheduler import VerificationScheduler, make_scheduler
from pipeline.engine.target_runner import TargetOutput
from pipeline.ops.paged_attention import BLOCK

METHODS = ("dspark", "dflash", None)


@dataclass
class SpecConfig:
    """vLLM-style ``speculative_config`` plus the scheduler choice."""

    method: str | None = None  # 'dspark' | 'dflash' | None (no speculation)
    num_speculative_tokens: int | None = None  # the verification depth cap, <= the drafter's block size; None -> it
    draft_sample_method: str = "probabilistic"  # 'greedy' | 'probabilistic'
    rejection_sample_method: str = "standard"  # 'standard' | 'block'
    scheduler: str | VerificationScheduler = "fixed"  # 'fixed' | 'threshold' | 'hardware' | 'async' | instance
    confidence_threshold: float = 0.0  # StaticThreshold θ
    cost_table: CostTable | str | None = None  # SPS(B) for 'hardware' / 'async' (object or JSON path)
    # per-position STS temperatures applied by the scheduler -- ONLY for drafters that return raw confidence logits
    # (pipeline.dspark.drafter.DSparkDrafter applies its config's sts_temperatures itself: leave None there)
    sts_temperatures: list | None = None
    async_lag: int = 2
    seed: int = 0  # engine RNG for requests without their own seed
    # capture the drafting round (DSparkDrafter) and the verification forward in CUDA graphs, one per padded
    # (rows, tokens) bucket (pipeline/engine/cuda_graphs.py); needs a CUDA target, the CPU path never uses them
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method must be 'greedy' or 'probabilistic', got {self.draft_sample_method!r}")
        if self.rejection_sample_method not in ("standard", "block"):
            raise ValueError("rejection_sample_method must be 'standard' or 'block'")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")

    def resolve(self, block_size: int) -> int:
        """num_speculative_tokens for a drafter of this block size (None: the block size); the one place the bound
        is checked."""
        k = self.num_speculative_tokens
        if k is not None and not 1 <= k <= int(block_size):
            raise ValueError(f"num_speculative_tokens {k} outside [1, block_size {block_size}]")
        return int(block_size) if k is None else int(k)

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpecConfig":
        if d is None:
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}")
        return cls(**d)


@dataclass
class RequestStats:
    """Per-request speculation statistics (docs/dspark.md §6 / §9).  A 'round' is one verification after the prefill."""

    num_speculative_tokens: int = 0  # the depth cap the request ran with
    rounds: int = 0
    proposed: int = 0  # drafts proposed (the block size per drafted round)
    verified: int = 0  # Σ L (drafts sent to the target)
    accepted: int = 0  # Σ m (accepted drafts, before stop truncation)
    emitted: int = 0  # tokens appended by rounds (m+1, or up to and including a stop) -- τ's numerator
    verified_at: list = field(default_factory=list)  # [k]: rounds that verified draft k+1
    accepted_at: list = field(default_factory=list)  # [k]: rounds whose first k+1 drafts were all accepted

    @property
    def tau(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def acceptance_rate(self) -> list:
        """accept_rate@k = P(first k+1 drafts accepted | >= k+1 verified) (cumulative, as DeepSpec)."""
        return [a / v if v else None for a, v in zip(self.accepted_at, self.verified_at)]

    def merge(self, other: "RequestStats") -> "RequestStats":
        n = max(len(self.verified_at), len(other.verified_at))
        pad = lambda x: list(x) + [0] * (n - len(x))  # noqa: E731
        return RequestStats(max(self.num_speculative_tokens, other.num_speculative_tokens), self.rounds + other.rounds, self.proposed + other.proposed,
                            self.verified + other.verified, self.accepted + other.accepted,
                            self.emitted + other.emitted,
                            [a + b for a, b in zip(pad(self.verified_at), pad(other.verified_at))],
                            [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tau"] = self.tau
        d["acceptance_rate"] = self.acceptance_rate()
        return d


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list
    output_ids: list  # all generated ids so far (EOS included when it ended the request)
    new_ids: list  # ids appended during the last step
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None  # the EOS id or stop string that ended the request
    text: str | None  # decoded output (stop string excluded) once finished, when a tokenizer is set
    stats: RequestStats
    # with logprobs=k: one (logprob, [(id, logprob)] * k best) per id of new_ids, the target's log-softmax of its raw
    # logits (before temperature / top-k / top-p) at that position; None without
    new_logprobs: list | None = None


@dataclass
class _Request:
    request_id: str
    prompt_ids: list
    params: SamplingParams
    max_tokens: int
    stop: list
    stop_ids: frozenset
    generator: torch.Generator | None
    logprobs: int | None = None  # top log-probabilities to return per token (0: the chosen token's only)
    slot: int = -1
    draft_state: object = None
    pending_ctx: list = field(default_factory=list)  # [(aux [n, k·d], start position)] not yet in draft_state
    pending_tokens: int = 0  # rows of pending_ctx
    prefill_pos: int = 0  # prompt tokens in the target's cache (chunked prefill: < len(prompt) while prefilling)
    footprint: int = 0  # cache positions reserved for it at admission (prompt + completion + a verification block)
    output_ids: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: object = None
    stop_window: int = 0
    text: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    arrival: int = 0

    @property
    def prefilled(self) -> bool:
        return self.prefill_pos >= len(self.prompt_ids)

    @property
    def seeded_sampling(self) -> bool:
        """Sampling with its own seeded generator: its random stream must depend on its seed only."""
        return self.generator is not None and self.params.temperature > 0


@dataclass
class EngineTimers:
    steps: int = 0
    draft_s: float = 0.0
    schedule_s: float = 0.0
    target_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    skipped_drafts: int = 0  # rounds in which the scheduler could verify nothing, so nothing was drafted

    @property
    def overhead_s(self) -> float:
        """Engine time outside drafting, scheduling, the target forward and the rejection sampler."""
        return self.total_s - self.draft_s - self.schedule_s - self.target_s - self.verify_s

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["overhead_s"] = self.overhead_s
        return d


@dataclass
class RoundProposal:
    """What the drafter proposed in one round for the R_d drafted requests (rows in proposal order)."""

    tokens: torch.Tensor  # [R_d, γ] int64 target ids, on the CPU
    q: torch.Tensor | None  # [R_d, γ, V_d] fp32 draft distributions (None = deterministic proposals)
    conf: torch.Tensor | None  # [R_d, γ] fp32 confidence logits on the CPU, or None
    draft_ids: torch.Tensor | None  # [V_d] target id of each draft index
    rows: dict  # request id -> its row of tokens / q / conf


@dataclass
class RoundBatch:
    """One engine round over R active requests: the P prefilling requests first (in arrival order), then the decoding
    ones (in cache-slot order, so their K/V are one view of the cache when the slots are consecutive).  Every per-request list is [R], indexed like ``requests``; the phases fill it in order."""

    requests: list  # [R] _Request
    num_prefill: int  # P
    chunks: list = field(default_factory=list)  # [P] prompt tokens each prefilling request feeds this round
    # plan depths
    depth_limits: list = field(default_factory=list)  # [R] most drafts L_r may verify (cap, budget, room); 0 prefill
    depths: list = field(default_factory=list)  # [R] L_r verified drafts (0: prefill, undrafted)
    drafted: list = field(default_factory=list)  # indices into `requests` that were drafted, in scheduler order
    proposal: RoundProposal | None = None
    q_rows: list = field(default_factory=list)  # [R] row of `proposal` per request, -1 when not drafted
    round_conf: dict = field(default_factory=dict)  # request id -> confidence logits [cap] (record_rounds)
    propose_s: float = 0.0
    # build the forward
    inputs: list = field(default_factory=list)  # [R] token lists: the prompt, or [x_0, x_1..x_L]
    num_logits: list = field(default_factory=list)  # [R] logits rows: 1 (prefill) or L_r + 1
    starts: list = field(default_factory=list)  # [R] target cache length before the forward (n)
    target_out: TargetOutput | None = None
    target_s: float = 0.0
    # verify
    result: VerifyResult | None = None  # m_r and the m_r + 1 tokens per request


def drafter_config(drafter):
    """The drafter's config (``.config``, or ``.cfg`` for nn.Module drafters)."""
    cfg = getattr(drafter, "config", None)
    if cfg is None or not hasattr(cfg, "block_size"):
        cfg = getattr(drafter, "cfg", None)
    if cfg is None or not hasattr(cfg, "block_size") or not hasattr(cfg, "aux_layer_ids"):
        raise TypeError("drafter needs a config with block_size and aux_layer_ids")
    return cfg


class SpeculativeEngine:
    def __init__(self, target_runner, drafter=None, spec_config: SpecConfig | dict | None = None, tokenizer=None,
                 eos_token_ids: Iterable[int] | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, prefill_slowdown: float | None = None,
                 round_cost: Callable[[int], float] | None = None):
        """max_num_batched_tokens: the most target tokens one round's forward takes (vLLM's name): the decoding
        requests' tokens first, then prompts in chunks, then verified drafts in what is left.  None: no cap (every
        prompt prefilled whole in its first round).

        prefill_slowdown (with round_cost: B target tokens -> seconds of a forward, e.g. the SPS table's step_time):
        while requests decode, a round's prompt chunk is at most what keeps its predicted forward within this
        factor of the decode rows' own (at least MIN_PREFILL_CHUNK tokens, so prompts always move): a long prompt
        arriving beside streaming requests stretches their inter-token latency by at most that factor."""
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if prefill_slowdown is not None and (prefill_slowdown <= 1.0 or round_cost is None):
            raise ValueError(f"prefill_slowdown must be > 1 and come with a round_cost, got {prefill_slowdown}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_slowdown = prefill_slowdown
        self.round_cost = round_cost
        self._chunk_caps: dict[int, int] = {}  # decode rows -> the priced prompt chunk
        self.target = target_runner
        self.spec = spec_config if isinstance(spec_config, SpecConfig) else SpecConfig.from_dict(spec_config)
        if drafter is None and self.spec.method is not None:
            raise ValueError(f"method {self.spec.method!r} needs a drafter (pipeline.dspark.checkpoint.load_drafter "
                             "loads an exported one)")
        if self.spec.method is None:
            drafter = None
        self.drafter = drafter
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = list(getattr(target_runner.config, "eos_token_ids", []) or [])
            if not eos_token_ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
                eos_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.max_model_len = min(int(max_model_len or target_runner.max_seq_len), int(target_runner.max_seq_len))
        if drafter is not None:
            dcfg = drafter_config(drafter)
            self.block_size = int(dcfg.block_size)  # drafts proposed per drafted round
            self.num_speculative_tokens = self.spec.resolve(self.block_size)  # at most this many verified
            self.aux_layer_ids = list(dcfg.aux_layer_ids)
        else:
            self.block_size = self.num_speculative_tokens = 0
            self.aux_layer_ids = []
        self.scheduler = make_scheduler(self.spec.scheduler, num_speculative_tokens=self.num_speculative_tokens,
                                        cost_table=self.spec.cost_table, threshold=self.spec.confidence_threshold,
                                        temperatures=self.spec.sts_temperatures, lag=self.spec.async_lag)
        self.sampler = RejectionSampler(self.spec.rejection_sample_method)
        self.generator = torch.Generator().manual_seed(int(self.spec.seed))
        self.requests: dict[str, _Request] = {}  # admitted: they hold a cache slot
        self.waiting: collections.deque[_Request] = collections.deque()  # added, waiting for cache room (FIFO)
        self._reserved = 0  # cache positions reserved by the admitted requests (paged cache)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.timers = EngineTimers()
        self.finished_stats = RequestStats()
        # Per-round records for evaluation / calibration: {request_id, L, m, conf} with conf the confidence logits
        # the drafter produced for that round (STS-scaled when the drafter has temperatures), or None.
        self.record_rounds = False
        self.round_log: list[dict] = []
        # Per-round shapes for benchmarks (None: not kept): (rows, prompt rows, target s, target tokens) per step
        self.shape_log: list[tuple] | None = None
        self.static_draft: StaticDraftProposer | None = None  # use_static_shapes; else drafter.propose
        if self.spec.cuda_graphs:
            if self.target.device.type != "cuda":
                raise ValueError(f"cuda_graphs needs a CUDA target, this one runs on {self.target.device}")
            self.use_static_shapes(capture=True)

    def use_static_shapes(self, capture: bool, shapes: StaticShapes | None = None) -> None:
        """Run the forwards that fit ``shapes``' buckets (and a DSparkDrafter's drafting rounds) padded to fixed
        shapes; ``capture`` records each bucket in a CUDA graph (CUDA only), without it the padded computation runs
        eagerly (how the CPU tests check padding against the ragged path)."""
        shapes = shapes or StaticShapes(max_tokens=self.num_speculative_tokens + 1)
        self.target.static_forward = StaticTargetForward(self.target, shapes, capture=capture)
        if isinstance(self.drafter, DSparkDrafter):
            self.static_draft = StaticDraftProposer(self.drafter, shapes, capture=capture)

    # ------------------------------------------------------------------ request management
    def add_request(self, prompt, params: SamplingParams | None = None, max_tokens: int = 16,
                    stop: Sequence[str] | str | None = None, stop_token_ids: Iterable[int] | None = None,
                    ignore_eos: bool = False, request_id: str | None = None, logprobs: int | None = None) -> str:
        """Queue a request (prefilled at the next ``step``).  ``prompt``: token ids, or a string (needs a tokenizer).
        EOS ids (engine's, unless ignore_eos) and ``stop_token_ids`` end the request with the id kept in output_ids;
        ``stop`` strings end it with the string cut from ``text``.  ``logprobs`` = k >= 0: every output carries the
        target's log-probability of each new token and its k most likely alternatives (``new_logprobs``)."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompt needs a tokenizer")
            prompt = self.tokenizer.encode(prompt)
        prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len {self.max_model_len}")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if logprobs is not None and not 0 <= int(logprobs) <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {logprobs}")
        stop = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid}")
        ids = set() if ignore_eos else set(self.eos_token_ids)
        ids |= {int(t) for t in (stop_token_ids or [])}
        gen = torch.Generator().manual_seed(int(params.seed)) if params.seed is not None else None
        req = _Request(rid, prompt, params, int(max_tokens), stop, frozenset(ids), gen,
                       logprobs=None if logprobs is None else int(logprobs),
                       stop_window=(4 * max(len(s) for s in stop) + 4) if stop else 0,
                       stats=RequestStats(num_speculative_tokens=self.num_speculative_tokens,
                                          verified_at=[0] * self.num_speculative_tokens,
                                          accepted_at=[0] * self.num_speculative_tokens),
                       arrival=next(self._arrivals))
        if rid in (w.request_id for w in self.waiting):
            raise ValueError(f"duplicate request id {rid}")
        req.footprint = min(len(prompt) + int(max_tokens), self.max_model_len) + self.num_speculative_tokens + 1
        capacity = self.cache_capacity()
        if capacity is not None and req.footprint > capacity:
            raise ValueError(f"a request of {len(prompt)} prompt + {max_tokens} completion tokens needs "
                             f"{req.footprint} positions of KV cache; the cache holds {capacity}")
        self.waiting.append(req)
        self._admit()
        return rid

    def cache_capacity(self) -> int | None:
        """Token positions the target's KV cache holds for all requests together (None: grows on demand)."""
        paged = getattr(self.target, "paged", None)
        return None if paged is None else paged.num_blocks * BLOCK

    def _admit(self) -> None:
        """Move waiting requests into the engine, first come first served, while the cache can hold every admitted
        request at its full length (so a running request never runs out of cache: the rest wait)."""
        capacity = self.cache_capacity()
        while self.waiting:
            req = self.waiting[0]
            need = -(-req.footprint // BLOCK) * BLOCK
            if capacity is not None and self._reserved + need > capacity:
                return
            self.waiting.popleft()
            self._reserved += need if capacity is not None else 0
            req.slot = self.target.alloc()
            self.requests[req.request_id] = req

    def queue_position(self, request_id: str) -> int | None:
        """0-based place of a request in the wait for cache room (None: admitted, finished or unknown)."""
        for i, r in enumerate(self.waiting):
            if r.request_id == request_id:
                return i
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            for w in list(self.waiting):
                if w.request_id == request_id:
                    self.waiting.remove(w)
                    w.finished, w.finish_reason = True, "abort"
                    return self._output(w, [])
            return None
        req.finished, req.finish_reason = True, "abort"
        self._release(req)
        return self._output(req, [])

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.waiting)

    def num_active(self) -> int:
        """Requests in the engine: admitted and waiting for cache room."""
        return len(self.requests) + len(self.waiting)

    def _release(self, req: _Request) -> None:
        if req.slot >= 0:
            self.target.free(req.slot)
            req.slot = -1
            if self.cache_capacity() is not None:
                self._reserved -= -(-req.footprint // BLOCK) * BLOCK
        if req.draft_state is not None:
            free = getattr(self.drafter, "free_state", None)
            if free is not None:
                free(req.draft_state)
            req.draft_state = None
        req.pending_ctx, req.pending_tokens = [], 0

    # ------------------------------------------------------------------ one round
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One round for every active request.  Returns an output for each request that got tokens or finished;
        finished requests are removed (their caches freed).

        Phases over one RoundBatch: plan the depths (draft + schedule), build and run the target forward, verify
        (rejection sampler), commit (statistics, stop handling, cache rollback)."""
        t_start = time.perf_counter()
        self._admit()
        reqs = sorted(self.requests.values(), key=lambda r: r.arrival)
        if not reqs:
            return []
        decode = sorted((r for r in reqs if r.prefilled), key=lambda r: r.slot)
        prefill, chunks = self._prefill_chunks([r for r in reqs if not r.prefilled], len(decode))
        batch = RoundBatch(requests=prefill + decode, num_prefill=len(prefill), chunks=chunks)
        self._plan_depths(batch)
        self._run_target(batch)
        self._verify(batch)
        outputs = self._commit(batch)
        # the drafter context is extended only before a round that drafts (a request that never drafts again costs
        # no drafter time); a long backlog is folded in anyway to bound its memory
        backlog = [r for r in self.requests.values() if r.pending_tokens >= self.MAX_PENDING_TOKENS]
        if backlog:
            t2 = time.perf_counter()
            self._flush_context(backlog)
            self.timers.draft_s += time.perf_counter() - t2
        self.timers.steps += 1
        round_s = time.perf_counter() - t_start
        self.timers.total_s += round_s
        target_tokens = sum(len(x) for x in batch.inputs)
        if self.shape_log is not None:
            self.shape_log.append((len(batch.requests), batch.num_prefill, batch.target_s, target_tokens))
        if not batch.num_prefill:  # what a decode round costs, for cost-aware schedulers (prefill is not typical)
            self.scheduler.observe_round(len(batch.drafted), batch.propose_s, target_tokens, batch.target_s, round_s)
        return outputs

    def _prefill_chunks(self, prefilling: list, num_decode: int) -> tuple[list, list]:
        """The prompts this round prefills and how many tokens of each: with max_num_batched_tokens, what the
        decoding requests' tokens leave of it, first come first served, a prompt split over as many rounds as it
        takes (chunked prefill); without, every pending prompt whole."""
        budget = self.max_num_batched_tokens
        if budget is None:
            return prefilling, [len(r.prompt_ids) - r.prefill_pos for r in prefilling]
        left = budget - num_decode
        if num_decode == 0:
            left = max(left, 1)  # nothing else runs: a prompt always moves
        elif self.prefill_slowdown is not None:
            left = min(left, self._priced_chunk(num_decode))
        out, chunks = [], []
        for r in prefilling:
            if left <= 0:
                break
            n = min(len(r.prompt_ids) - r.prefill_pos, left)
            out.append(r)
            chunks.append(n)
            left -= n
        return out, chunks

    MIN_PREFILL_CHUNK = 16

    def _priced_chunk(self, num_decode: int) -> int:
        """The most prompt tokens beside ``num_decode`` decode rows whose forward the cost model prices within
        ``prefill_slowdown`` x the decode rows' alone (never fewer than MIN_PREFILL_CHUNK)."""
        c = self._chunk_caps.get(num_decode)
        if c is None:
            limit = self.prefill_slowdown * self.round_cost(num_decode)
            lo, hi = 0, max(0, self.max_num_batched_tokens - num_decode)
            while lo < hi:  # the largest c in [0, hi] with cost(num_decode + c) <= limit (cost grows with tokens)
                mid = (lo + hi + 1) // 2
                if self.round_cost(num_decode + mid) <= limit:
                    lo = mid
                else:
                    hi = mid - 1
            c = self._chunk_caps[num_decode] = max(lo, self.MIN_PREFILL_CHUNK)
        return c

    def _plan_depths(self, batch: RoundBatch) -> None:
        """Depth caps (remaining budget, cache room), the drafting decision, the proposal and the scheduler's L_r."""
        T = self.target
        P = batch.num_prefill
        R = len(batch.requests)
        batch.depth_limits = [0] * R
        batch.depths = [0] * R
        batch.q_rows = [-1] * R
        for i in range(P, R):
            r = batch.requests[i]
            md = min(self.num_speculative_tokens, r.max_tokens - len(r.output_ids) - 1, self.max_model_len - T.length(r.slot) - 1)
            batch.depth_limits[i] = max(0, md)
        spec = [i for i in range(P, R) if batch.depth_limits[i] > 0] if self.drafter is not None else []
        if spec and self.max_num_batched_tokens is not None:
            # the decoding requests' share of the round's token budget: their anchors plus the verified drafts
            share = self.max_num_batched_tokens - sum(batch.chunks)
            self.scheduler.set_round(sum(batch.chunks), share)
            if not self.scheduler.takes_round_budget:  # the budget split evenly, fixed before any draft exists
                each = max(0, share - (R - P)) // len(spec)
                for i in spec:
                    batch.depth_limits[i] = min(batch.depth_limits[i], each)
                spec = [i for i in spec if batch.depth_limits[i] > 0]
        # a seeded sampling request's random stream must not depend on the batch it shares: skipping the drafting
        # round (a batch-level decision) would change what it consumes, so such a round drafts anyway
        if (spec and not self.scheduler.draft_this_round(len(spec))
                and not any(batch.requests[i].seeded_sampling for i in spec)):
            self.timers.skipped_drafts += 1
            spec = []
        batch.drafted = spec
        if not spec:
            return
        t0 = time.perf_counter()
        prop = self._propose([batch.requests[i] for i in spec])
        t1 = time.perf_counter()
        batch.propose_s = t1 - t0
        self.timers.draft_s += batch.propose_s
        batch.proposal = prop
        for i in spec:
            batch.q_rows[i] = prop.rows[batch.requests[i].request_id]
        conf_rows = None  # [len(spec), num_speculative_tokens] fp32, in the order of `spec`
        if prop.conf is not None:
            conf_rows = prop.conf[torch.tensor([batch.q_rows[i] for i in spec])][:, :self.num_speculative_tokens]
        ds = self.scheduler.schedule(conf_rows, [batch.depth_limits[i] for i in spec])
        if self.record_rounds and conf_rows is not None:
            batch.round_conf = {batch.requests[i].request_id: conf_rows[j].tolist() for j, i in enumerate(spec)}
        for i, d in zip(spec, ds):
            if batch.requests[i].seeded_sampling:
                # a seeded sampling request is verified at full depth (vLLM's fixed num_speculative_tokens): its
                # random stream, hence its output, then depends on its seed only, not on the batch or the load
                d = batch.depth_limits[i]
            batch.depths[i] = int(min(d, batch.depth_limits[i]))
        self.timers.schedule_s += time.perf_counter() - t1

    def _run_target(self, batch: RoundBatch) -> None:
        """ONE target forward: prompts (1 logits row each) and [x_0, x_1..x_L] (L+1 rows) for the decoding requests."""
        T = self.target
        P = batch.num_prefill
        tok_cpu = batch.proposal.tokens.tolist() if batch.proposal is not None else None
        batch.inputs, batch.num_logits, batch.starts = [], [], []
        for i, r in enumerate(batch.requests):
            if i < P:  # a prompt chunk; the chunk that completes the prompt gets the logits of its last token
                n, start = batch.chunks[i], r.prefill_pos
                batch.inputs.append(r.prompt_ids[start:start + n])
                batch.num_logits.append(1 if start + n == len(r.prompt_ids) else 0)
                batch.starts.append(start)
                continue
            L = batch.depths[i]
            batch.inputs.append([r.output_ids[-1]] + (tok_cpu[batch.q_rows[i]][:L] if L else []))
            batch.num_logits.append(L + 1)
            batch.starts.append(T.length(r.slot))
        t0 = time.perf_counter()
        batch.target_out = T.forward([r.slot for r in batch.requests], batch.inputs, logits_last=batch.num_logits,
                                     aux_layer_ids=self.aux_layer_ids)
        batch.target_s = time.perf_counter() - t0
        self.timers.target_s += batch.target_s

    def _verify(self, batch: RoundBatch) -> None:
        """The rejection sampler over the round; the scheduler sees what the drafted rows' verification gave."""
        t0 = time.perf_counter()
        prop, out = batch.proposal, batch.target_out
        sampled = [i for i, k in enumerate(batch.num_logits) if k > 0]  # not the prompts still being prefilled
        res = self.sampler(out.logits, [out.logit_offsets[i] for i in sampled], prop.tokens if prop else None,
                           [batch.depths[i] for i in sampled], prop.q if prop else None,
                           prop.draft_ids if prop else None, [batch.requests[i].params for i in sampled],
                           [batch.requests[i].generator or self.generator for i in sampled],
                           q_rows=[batch.q_rows[i] for i in sampled])
        if len(sampled) == len(batch.requests):
            batch.result = res
        else:  # a request without logits this round gets no tokens
            m, toks = [0] * len(batch.requests), [[] for _ in batch.requests]
            for j, i in enumerate(sampled):
                m[i], toks[i] = res.num_accepted[j], res.tokens[j]
            batch.result = VerifyResult(num_accepted=m, tokens=toks)
        self.timers.verify_s += time.perf_counter() - t0
        if prop is not None:  # in the order the scheduler saw them
            self.scheduler.observe_acceptance([batch.depths[i] for i in batch.drafted],
                                              [batch.result.num_accepted[i] for i in batch.drafted])

    def _commit(self, batch: RoundBatch) -> list[RequestOutput]:
        """Statistics, tokens with stop handling, cache rollback to the verified prefix; finished requests leave."""
        T = self.target
        res, out = batch.result, batch.target_out
        outputs = []
        for i, r in enumerate(batch.requests):
            m, toks = res.num_accepted[i], res.tokens[i]
            is_prefill = i < batch.num_prefill
            n = batch.starts[i]
            if is_prefill:
                r.prefill_pos = n + batch.chunks[i]
                emitted = self._append(r, toks)  # nothing until the chunk that completes the prompt
            else:
                L = batch.depths[i]
                st = r.stats
                st.rounds += 1
                st.proposed += self.block_size if batch.q_rows[i] >= 0 else 0
                st.verified += L
                st.accepted += m
                for k in range(L):
                    st.verified_at[k] += 1
                for k in range(m):
                    st.accepted_at[k] += 1
                if self.record_rounds:
                    self.round_log.append({"request_id": r.request_id, "L": L, "m": m,
                                           "conf": batch.round_conf.get(r.request_id)})
                emitted = self._append(r, toks)
                st.emitted += len(emitted)
            lps = self._logprobs(r, out.logits_of(i), emitted) if r.logprobs is not None and emitted else None
            if r.finished:
                self._release(r)
                del self.requests[r.request_id]
                self.finished_stats = self.finished_stats.merge(r.stats)
            else:
                # target cache keeps the verified prefix [x_0..x_m]; the new anchor (last token) is not cached yet
                keep = r.prefill_pos if is_prefill else n + m + 1
                T.truncate(r.slot, keep)
                if self.drafter is not None:  # the drafter's context follows lazily (_flush_context)
                    aux = out.aux_of(i)
                    kept = aux if is_prefill else aux[:m + 1]
                    r.pending_ctx.append((kept.clone(), n))
                    r.pending_tokens += kept.shape[0]
            outputs.append(self._output(r, emitted, lps))
        return outputs

    MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)

    @staticmethod
    def _logprobs(r: _Request, logits: torch.Tensor, emitted: list) -> list:
        """The target's log-probabilities of the emitted tokens: row k of this request's logits predicted emitted[k]
        (an accepted draft token or the bonus / corrected one alike)."""
        lp = torch.log_softmax(logits[:len(emitted)].float(), dim=-1)  # [n, V]
        ids = torch.tensor(emitted, dtype=torch.long)
        chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
        if r.logprobs:
            top_v, top_i = lp.topk(r.logprobs, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
        else:
            tops = [[] for _ in emitted]
        return list(zip(chosen, tops))

    # verified tokens a request may hold before its drafter context is extended without a drafting round (their
    # aux hidden states: n_aux·d values each, 7 KiB in fp32 for SmolLM2)
    MAX_PENDING_TOKENS = 2048

    def _flush_context(self, reqs: Sequence[_Request]) -> None:
        """Append every request's pending verified tokens to its drafter context: one batched pass with
        ``extend_contexts`` (pipeline.dspark.drafter.DSparkDrafter; a request's rounds concatenated), else one
        ``extend_context`` call per round in order."""
        todo = [r for r in reqs if r.pending_ctx]
        for r in todo:
            if r.draft_state is None:
                r.draft_state = self.drafter.new_state()
        if hasattr(self.drafter, "extend_contexts"):
            self.drafter.extend_contexts(
                [r.draft_state for r in todo],
                [r.pending_ctx[0][0] if len(r.pending_ctx) == 1 else torch.cat([a for a, _ in r.pending_ctx])
                 for r in todo],
                [r.pending_ctx[0][1] for r in todo])
        else:
            for r in todo:
                for aux, pos in r.pending_ctx:
                    self.drafter.extend_context(r.draft_state, aux, pos)
        for r in todo:
            r.pending_ctx, r.pending_tokens = [], 0

    def _propose(self, decode: list[_Request]) -> RoundProposal:
        """Group requests by draft sampling params (seeded requests alone, with their own generator)."""
        self._flush_context(decode)
        groups: dict = {}
        for r in decode:
            dp = self._draft_params(r.params)
            key = (dp, id(r.generator)) if r.generator is not None else (dp, None)
            groups.setdefault(key, []).append(r)
        propose = self.static_draft or self.drafter.propose
        toks, qs, confs, q_row = [], [], [], {}
        draft_ids = None
        has_conf = True
        o = 0
        for (dp, _), rs in groups.items():
            for r in rs:
                if r.draft_state is None:  # defensive: a request always has a state after its prefill
                    r.draft_state = self.drafter.new_state()
            anchors = torch.tensor([r.output_ids[-1] for r in rs], dtype=torch.long)
            gen = rs[0].generator or self.generator
            p = propose([r.draft_state for r in rs], anchors, dp, gen)
            toks.append(p.tokens)
            qs.append(p.q)
            if p.conf_logits is None:
                has_conf = False
            confs.append(p.conf_logits)
            draft_ids = p.draft_ids
            for j, r in enumerate(rs):
                q_row[r.request_id] = o + j
            o += len(rs)
        cat = (lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs))  # noqa: E731
        tokens = cat(toks).cpu()
        q = None if any(x is None for x in qs) else cat(qs)
        conf = cat(confs).float().cpu() if has_conf else None
        return RoundProposal(tokens=tokens, q=q, conf=conf, draft_ids=draft_ids, rows=q_row)

    def _draft_params(self, p: SamplingParams) -> SamplingParams:
        if p.greedy or self.spec.draft_sample_method == "greedy":
            return SamplingParams(temperature=0.0)
        return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)

    # ------------------------------------------------------------------ stop handling
    def _append(self, r: _Request, toks: list) -> list:
        """Append tokens one by one; stop at EOS / stop id (kept), stop string (kept in ids, cut from text),
        max_tokens.  Returns the appended tokens."""
        appended = []
        for t in toks:
            r.output_ids.append(int(t))
            appended.append(int(t))
            if t in r.stop_ids:
                r.finished, r.finish_reason, r.stop_reason = True, "stop", int(t)
                break
            if r.stop:
                s = self._stop_string(r)
                if s is not None:
                    r.finished, r.finish_reason, r.stop_reason = True, "stop", s
                    break
            if len(r.output_ids) >= r.max_tokens:
                r.finished, r.finish_reason = True, "length"
                break
            if len(r.prompt_ids) + len(r.output_ids) >= self.max_model_len:
                r.finished, r.finish_reason = True, "length"
                break
        return appended

    def _stop_string(self, r: _Request):
        tail = self.tokenizer.decode(r.output_ids[-r.stop_window:], skip_special_tokens=True)
        for s in r.stop:
            if s in tail:
                return s
        return None

    def _output(self, r: _Request, new_ids: list, new_logprobs: list | None = None) -> RequestOutput:
        text = None
        if r.finished and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            if r.finish_reason == "stop" and isinstance(r.stop_reason, str):
                k = text.find(r.stop_reason)
                if k >= 0:
                    text = text[:k]
            r.text = text
        return RequestOutput(r.request_id, r.prompt_ids, list(r.output_ids), list(new_ids), r.finished,
                             r.finish_reason, r.stop_reason, text, r.stats,
                             (new_logprobs or []) if r.logprobs is not None else None)

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_tokens: int | Sequence[int] = 16, stop=None, stop_token_ids=None,
                 ignore_eos: bool = False) -> list[RequestOutput]:
        """Run the given prompts to completion (batched, together with anything already queued); outputs in order."""
        n = len(prompts)
        ps = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        mts = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * n
        ids = [self.add_request(p, ps[i], mts[i], stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
               for i, p in enumerate(prompts)]
        want = set(ids)
        done: dict[str, RequestOutput] = {}
        while want - set(done):
            for o in self.step():
                if o.finished and o.request_id in want:
                    done[o.request_id] = o
        return [done[i] for i in ids]
