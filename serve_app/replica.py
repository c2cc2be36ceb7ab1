"""Engine replica: one Ray Serve replica = TargetRunner + (optional) DSpark drafter + SpeculativeEngine, driven by a
continuous-batching loop.

Continuous batching
  * ``generate(request)`` is a streaming (async generator) method.  It queues the request and yields events
    ``{"token_ids", "text", "finished", "finish_reason", "replica", ...}``: the first as soon as the request has a
    token, then one whenever ``stream_interval`` more tokens are ready (1: every engine round that gave it tokens),
    and the last, which carries the rest of the tokens and the request's speculative stats; a request with
    ``"stream": False`` gets only the first and the last event (serve_app/events.py).
  * ONE background asyncio task owns the engine.  Between rounds it applies aborts, admits queued requests up to
    ``max_batch`` (the rest wait, FIFO), refreshes the load shift, then runs ``engine.step()`` in a single-thread
    executor so the replica's event loop stays responsive (new requests, routing-stats calls, cancellations) while the
    target forward runs.  Requests join and leave only between rounds: the engine is never touched concurrently.
  * A cancelled caller (client disconnect -> the ingress cancels the handle stream -> Serve cancels this generator)
    aborts its request at the next round boundary and frees its KV slot / draft state.
  * Text is detokenized incrementally; with stop strings the last ``max(len(stop)) - 1`` characters are held back
    until the request finishes, so no part of a stop string is ever streamed.

Verification-depth policy (schedulers)
  * ``none``: no speculation (plain batched autoregressive decoding; the drafter is not loaded).
  * ``fixed``: verify min(num_speculative_tokens, remaining) drafts every round (default: the drafter's block size).
  * ``hardware``: docs/dspark.md §7 Algorithm 1 (greedy prefix admission with the early stop) on this replica's SPS(B)
    table; ``async``: the production variant (capacity from the unconstrained search two rounds earlier).
  * SPS(B) is profiled once at replica start (``CostTable.profile``, bounded batch sizes) and cached at
    ``<work>/cache/sps-<hash>.json`` (hash of target, dtype, device, threads, profile settings, torch version); an OS
    lock (pipeline/core/file_lock.py: dropped by the kernel if its holder dies, waited for at most a bound) makes
    co-located replicas profile one at a time (a concurrent profile would measure contention) and reuse the cache.  ``reprofile()`` re-measures on demand (between rounds) and replaces the table.
  * Cluster load (from the router, serve_app/router.py): every routed request carries ``_route`` with, per replica,
    the target tokens of its last round (B_i) and the tokens it emitted in that round (τ_i), plus the cluster load
    factor (active+queued over total batch capacity).  The replica keeps the latest view (ignored once older than
    ``route_ttl_s``) and runs Algorithm 1 on the SHARED hardware: the other replicas' work is a base load

        B_0 = shared_hardware · Σ_{j≠me} B_j,   τ_0 = shared_hardware · Σ_{j≠me} τ_j,
        Θ = (τ_0 + τ)·SPS(B_0 + B),   admit one more draft token iff  a > (τ_0 + τ)·(SPS(B_0+B)/SPS(B_0+B+1) − 1)

    i.e. co-located replicas are treated as one batch: a verify token of mine slows everyone's round, so its bar
    includes their expected tokens too, and a busier cluster verifies fewer tokens per request -- the paper's "heavy
    load -> shallower verification" extended from one engine to the cluster.  ``shared_hardware`` is the fraction of
    the other replicas' work that lands on this replica's hardware: 1.0 when replicas share cores / an accelerator
    (the CPU case here), 0.0 when each owns its device (B_0 = τ_0 = 0: exactly Algorithm 1 on its own batch).
    (Merely shifting SPS by B_0 without τ_0 would LOWER the bar on a concave SPS curve -- Δt/t(B) falls with B --
    see tests/test_serve.py.)  ``token_budget`` (optional) caps this replica's target tokens per forward.  B_0, τ_0
    and the cap are fixed BEFORE a round's drafts exist and the early stop is kept, so the depth rule stays
    lossless (docs/dspark.md §7: whether x_j is verified depends only on x_<j).  ``async`` uses the same objective for its
    lagged, unconstrained capacity search.
  * ``fixed`` and ``none`` ignore the load (baselines).

Load reporting: ``record_routing_stats()`` (polled by the Serve controller every ``request_routing_stats_period_s``)
returns active / queued requests, tokens in the last round, recent step time, steps/s and tokens/s, the load shift,
cumulative speculation counters, the verified-depth histogram and the SPS table; the router uses it for placement
and the ingress exposes it on /metrics.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ray import serve

from pipeline.dspark.checkpoint import load_drafter
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.data.prompts import end_of_turn_ids
from pipeline.core.runtime import apply_env
from pipeline.ops.packed_linear import use_bf16_kernel
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.cost_table import CostTable, ProfileSpec, load_or_profile_cost_table
from pipeline.engine.scheduler import FixedDepth, make_load_aware_scheduler
from pipeline.engine.target_runner import TargetRunner, auto_precision, kv_cache_tokens, paged_kv_dtype
from serve_app.events import EventCoalescer

logger = logging.getLogger("ray.serve")

SCHEDULER_CHOICES = ("none", "fixed", "hardware", "async")
ENGINE_METHOD = "generate"  # the streaming method the router annotates with the cluster view


class ReplicaInitTimeout(RuntimeError):
    """An engine replica whose engine was not built within ``init_timeout_s`` (the message says at which stage)."""


# ----------------------------------------------------------------------------------------------------- options
@dataclass
class ReplicaOptions:
    """Everything an engine replica needs (plain data; built by serve_app.app.ServeConfig)."""

    target: str
    drafter: str | None = None
    scheduler: str = "hardware"  # 'none' | 'fixed' | 'hardware' | 'async'
    num_speculative_tokens: int | None = None  # the verification depth cap (<= drafter block size); None -> it
    dtype: str = "float32"
    device: str = "cpu"
    max_batch: int = 8  # concurrent requests in the engine; more wait in the replica queue
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = 256  # target tokens per round: decode first, prompts in chunks, then drafts
    prefill_slowdown: float | None = None  # x: a prompt chunk beside decode rows slows their round at most x times
    kv_cache_gb: float = 2.0  # the paged KV cache's budget (all requests of the replica together)
    threads: int | None = None  # torch intra-op threads (None: leave as is)
    draft_sample_method: str = "probabilistic"
    seed: int = 0
    cost_table: str | None = None  # a saved CostTable JSON (skips profiling)
    profile_batch_sizes: list = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    profile_context_len: int = 128
    profile_repeats: int = 3
    cache_dir: str | None = None  # None -> <work>/cache
    shared_hardware: float = 1.0
    token_budget: int | None = None
    route_ttl_s: float = 10.0
    model_name: str = "model"
    stream_interval: int = 1  # tokens per streamed event after the first (the first and the last always go)
    init_timeout_s: float = 900.0  # a replica whose engine is not built within this fails with ReplicaInitTimeout

    def __post_init__(self):
        if self.scheduler not in SCHEDULER_CHOICES:
            raise ValueError(f"scheduler must be one of {SCHEDULER_CHOICES}, got {self.scheduler!r}")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_batch:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed max_batch "
                             f"({self.max_batch}): the decoding requests alone would use up every round")
        if self.prefill_slowdown is not None and self.prefill_slowdown <= 1.0:
            raise ValueError(f"prefill_slowdown must be > 1 (or None: chunks up to the round's budget), got "
                             f"{self.prefill_slowdown}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if not 0.0 <= self.shared_hardware <= 1.0:
            raise ValueError("shared_hardware must lie in [0, 1]")
        if self.init_timeout_s <= 0:
            raise ValueError(f"init_timeout_s must be > 0, got {self.init_timeout_s}")

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.scheduler != "none"

    def profile_spec(self) -> ProfileSpec:
        """What this replica's SPS profile measures and where it is cached."""
        return ProfileSpec(target=self.target, dtype=self.dtype, device=self.device,
                           batch_sizes=list(self.profile_batch_sizes), context_len=self.profile_context_len,
                           repeats=self.profile_repeats, cache_dir=self.cache_dir)


# ----------------------------------------------------------------------------------------------------- per request
@dataclass
class _Live:
    rid: str
    queue: asyncio.Queue
    args: dict
    coalescer: EventCoalescer  # which engine outputs become events
    hold: int = 0  # characters held back for stop strings
    sent_chars: int = 0
    admitted: bool = False
    finished: bool = False
    routing: list | None = None  # the router's ranking when it placed this request
    t_arrival: float = field(default_factory=time.perf_counter)


def _stats_dict(st) -> dict:
    rounds = st.rounds
    return {
        "rounds": rounds, "proposed_tokens": st.proposed, "verified_tokens": st.verified,
        "accepted_tokens": st.accepted, "emitted_tokens": st.emitted,
        "mean_verified_depth": st.verified / rounds if rounds else 0.0,
        "acceptance_length": st.tau if rounds else 0.0,
        "acceptance_rate": [None if a is None else round(a, 4) for a in st.acceptance_rate()],
        "verified_at": list(st.verified_at),
    }


def engine_executor(threads: int) -> ThreadPoolExecutor:
    """The one thread the engine's rounds run on, with ``threads`` OpenMP / MKL threads of its own.

    Both counts are per thread and a new thread starts from OMP_NUM_THREADS, which Ray sets to an actor's CPU
    reservation (1 for a replica by default).  ``torch.set_num_threads`` in ``__init__`` reaches another thread only
    when that thread first enters ATen's parallel_for; until then its GEMMs run on one core (a 2048 x 2048 matmul in
    a 1-CPU actor's executor thread: 0.98 cores busy, 1.81 with this initializer)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine", initializer=torch.set_num_threads,
                              initargs=(int(threads),))


class EngineReplica:
    """The engine deployment class (decorated below).  Constructor args: ``ReplicaOptions`` as a dict, and (outside
    Serve only: a benchmark driving several replicas in one process) an engine thread to share, which the replica
    then neither owns nor shuts down."""

    def __init__(self, options: dict, executor: ThreadPoolExecutor | None = None):
        apply_env()
        from transformers import AutoTokenizer

        self.opts = opts = ReplicaOptions(**options)
        if opts.threads:
            torch.set_num_threads(int(opts.threads))
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = f"local-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(opts.target)
        # Every torch computation of the replica runs on the executor's one thread, the engine's construction (weights,
        # kernel probes, SPS profile) included.  A second thread that has run an OpenMP parallel region keeps a
        # worker pool of its own; libgomp, then counting more threads than CPUs, all but stops spinning between
        # parallel regions, and each of the hundreds of regions of a forward waits for a sleeping worker, which makes
        # every token markedly slower (measurements: docs/results/load_test.md).
        self._owns_executor = executor is None
        self._executor = executor or engine_executor(int(opts.threads) if opts.threads else torch.get_num_threads())
        self.init_stage = "starting"
        try:
            self._executor.submit(self._build_engine).result(timeout=opts.init_timeout_s)
        except concurrent.futures.TimeoutError:
            msg = (f"engine replica {self.replica_id} did not initialize within {opts.init_timeout_s:g} s "
                   f"(--replica-init-timeout-s); it was {self.init_stage}")
            logger.error(msg)
            if self._owns_executor:
                self._executor.shutdown(wait=False, cancel_futures=True)
            raise ReplicaInitTimeout(msg) from None
        self.load_s = time.perf_counter() - t0

        self._live: dict[str, _Live] = {}
        self._pending: collections.deque[_Live] = collections.deque()
        self._aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._task: asyncio.Task | None = None
        # load / stats
        self._route: dict = {}
        self._route_ts = 0.0
        self._cluster_load = 0.0
        self._tokens_last_round = 0
        self._emitted_last_round = 0
        self._step_ema = None
        self._recent: collections.deque = collections.deque(maxlen=256)  # (t_end, step_s, emitted, B)
        self._depth_hist = [0] * (self.engine.num_speculative_tokens + 1)
        self._totals = collections.Counter()
        self._prev_stats: dict[str, tuple] = {}
        logger.info("engine replica %s ready in %.1fs (speculative=%s, scheduler=%s, num_speculative_tokens=%s, SPS "
                    "cache %s)", self.replica_id, self.load_s, opts.speculative, opts.scheduler,
                    self.engine.num_speculative_tokens,
                    self.cost_path)

    def _build_engine(self) -> None:
        """Target runner, drafter, scheduler (SPS table) and engine, on the engine's thread (see __init__)."""
        self.built_on_thread = threading.get_ident()
        opts = self.opts
        self.init_stage = f"loading the target {opts.target} ({opts.dtype}; the CPU linear kernel's first load)"
        dtype = self.precision = auto_precision(opts.device) if opts.dtype == "auto" else opts.dtype
        self.runner = TargetRunner.from_pretrained(opts.target, dtype=dtype, device=opts.device,
                                                   max_seq_len=opts.max_model_len,
                                                   kv_cache_tokens=kv_cache_tokens(
                                                       opts.target, opts.kv_cache_gb,
                                                       paged_kv_dtype(dtype).itemsize))
        drafter = None
        self.cost_table = self.cost_path = None
        self.load_sched = None
        if opts.speculative:
            self.init_stage = f"loading the drafter {opts.drafter}"
            drafter = load_drafter(opts.drafter, opts.target, dtype=self.runner.dtype, device=self.runner.device)
            if self.runner.linear_backend == "invariant":  # the drafter's linears on the target's bf16 kernel too
                use_bf16_kernel(drafter)
            spec = SpecConfig(method=drafter.cfg.kind, num_speculative_tokens=opts.num_speculative_tokens,
                              draft_sample_method=opts.draft_sample_method, seed=opts.seed)
            cap = spec.resolve(drafter.cfg.block_size)  # ValueError naming the bound
            if opts.scheduler == "fixed":
                spec.scheduler = FixedDepth(cap)
            else:
                if opts.cost_table:
                    self.cost_table, self.cost_path = CostTable.load(opts.cost_table), Path(opts.cost_table)
                else:
                    self.init_stage = "profiling the SPS cost table (or waiting for another replica's profile)"
                    self.cost_table, self.cost_path, _ = load_or_profile_cost_table(self.runner, opts.profile_spec(),
                                                                                    cap + 1)
                spec.scheduler = self.load_sched = make_load_aware_scheduler(opts.scheduler, self.cost_table,
                                                                             opts.token_budget)
        else:
            spec = SpecConfig(seed=opts.seed)
        priced = opts.prefill_slowdown is not None and opts.max_num_batched_tokens is not None
        if priced and self.cost_table is None:  # the prompt chunks are priced on the SPS table too
            self.init_stage = "profiling the SPS cost table (or waiting for another replica's profile)"
            self.cost_table, self.cost_path, _ = load_or_profile_cost_table(self.runner, opts.profile_spec(), 1)
        self.init_stage = "building the engine"
        eos = set(self.runner.config.eos_token_ids) | set(end_of_turn_ids(self.tokenizer))
        self.engine = SpeculativeEngine(self.runner, drafter, spec, tokenizer=self.tokenizer, eos_token_ids=eos,
                                        max_model_len=opts.max_model_len,
                                        max_num_batched_tokens=opts.max_num_batched_tokens,
                                        prefill_slowdown=opts.prefill_slowdown if priced else None,
                                        round_cost=self.cost_table.step_time if priced else None)

    # ------------------------------------------------------------------------------------------- public methods
    async def generate(self, request: dict, _route: dict | None = None):
        """Stream events for one request.  ``request``: prompt_ids, max_tokens, temperature, top_p, top_k, seed,
        stop, stop_token_ids, ignore_eos, request_id (optional).  ``_route``: injected by the router."""
        self._ensure_loop()
        if _route:
            self._route, self._route_ts = dict(_route), time.time()
        rid = str(request.get("request_id") or f"req-{uuid.uuid4().hex[:12]}")
        while rid in self._live:
            rid = f"{rid}-{uuid.uuid4().hex[:4]}"
        stop = request.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        live = _Live(rid, asyncio.Queue(), dict(request, stop=stop), hold=max((len(s) for s in stop), default=1) - 1,
                     coalescer=EventCoalescer(self.opts.stream_interval, request),
                     routing=(_route or {}).get("ranking"))
        self._live[rid] = live
        self._pending.append(live)
        self._totals["requests"] += 1
        self._wake.set()
        try:
            while True:
                ev = await live.queue.get()
                yield ev
                if ev.get("finished"):
                    break
        finally:
            if not live.finished:  # cancelled (client gone) or the consumer stopped early
                self._totals["aborted"] += 1
                self._aborts.add(rid)
                self._wake.set()
            self._live.pop(rid, None)

    async def record_routing_stats(self) -> dict:
        """Load report polled by the Serve controller and handed to the router (``replica.routing_stats``)."""
        now = time.time()
        horizon = time.perf_counter() - 5.0
        rec = [r for r in self._recent if r[0] >= horizon]
        busy = sum(r[1] for r in rec)
        steps_per_s = len(rec) / 5.0
        tokens_per_s = sum(r[2] for r in rec) / 5.0
        step_s = self._step_ema
        idle = self.engine.num_active() == 0 and not self._pending
        if (step_s is None or idle) and self.cost_table is not None:
            # an idle replica's next round holds one request: its profiled t(1) rather than the EMA of its last
            # busy rounds (a long prompt's prefill chunks would keep an idle replica looking slow to the router),
            # unless those were faster (a profile taken while something else had the cores)
            t1 = self.cost_table.step_time(1)
            step_s = t1 if step_s is None else min(step_s, t1)
        return {
            "replica": self.replica_id, "ts": now,
            "dtype": self.precision,  # --dtype, with auto resolved
            "active": self.engine.num_active(), "queued": len(self._pending), "max_batch": self.opts.max_batch,
            "tokens_last_round": self._tokens_last_round if rec else 0,
            "step_s": step_s, "steps_per_s": steps_per_s, "tokens_per_s": tokens_per_s, "busy_fraction": busy / 5.0,
            "emitted_last_round": self._emitted_last_round if rec else 0,
            "load_shift": self.load_sched.base_tokens if self.load_sched is not None else 0,
            "load_tau": self.load_sched.base_tau if self.load_sched is not None else 0.0,
            "cluster_load": self._cluster_load,
            "scheduler": self.opts.scheduler if self.opts.speculative else "none", "num_speculative_tokens": self.engine.num_speculative_tokens,
            "totals": dict(self._totals), "depth_hist": list(self._depth_hist),
            "sps": ({str(b): round(1.0 / t, 3) for b, t in self.cost_table.points}
                    if self.cost_table is not None else {}),
            # live round costs the load-aware scheduler uses besides SPS(B) (pipeline.engine.scheduler.LiveRoundCost)
            "live_cost": self.load_sched.live.to_dict() if self.load_sched is not None else {},
            "cost_scale": self.load_sched.live.scale if self.load_sched is not None else None,
            "skipped_drafts": self.engine.timers.skipped_drafts,
            # of which the cost model's bound ruled out (no probe spent): drafting could not pay at that load
            "model_skips": getattr(self.load_sched, "model_skips", 0),
            # plain rounds run to measure what drafting is compared with (control_every)
            "control_rounds": getattr(self.load_sched, "control_rounds", 0),
        }

    async def stats(self) -> dict:
        """The same report, plus static info (for /metrics warm-up and debugging)."""
        d = await self.record_routing_stats()
        d.update(model=self.opts.model_name, max_model_len=self.opts.max_model_len, load_s=self.load_s,
                 cost_table_path=str(self.cost_path) if self.cost_path else None,
                 engine_timers=self.engine.timers.to_dict())
        return d

    async def reprofile(self) -> dict:
        """Re-measure SPS(B) now (between rounds), replace the cached table and the scheduler's curve."""
        if self.load_sched is None:
            return {"profiled": False, "reason": "scheduler does not use a cost table"}
        self._ensure_loop()
        loop = asyncio.get_running_loop()
        async with self._lock:
            table, path, _ = await loop.run_in_executor(
                self._executor, lambda: load_or_profile_cost_table(self.runner, self.opts.profile_spec(),
                                                   self.engine.num_speculative_tokens + 1,
                                                                   force=True))
            self.cost_table, self.cost_path = table, path
            self.load_sched.cost = table
            self.load_sched.live.new_table()
        return {"profiled": True, "path": str(path), "step_seconds": dict(table.points)}

    async def check_health(self):
        if self._task is not None and self._task.done() and not self._task.cancelled():
            exc = self._task.exception()
            raise RuntimeError(f"engine loop died: {exc!r}")

    async def aclose(self) -> None:
        """Stop the engine loop and its executor (a replica driven outside Serve, e.g. by a benchmark, before its
        event loop closes)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._owns_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __del__(self):
        try:
            if self._task is not None:
                self._task.cancel()
            if self._owns_executor:
                self._executor.shutdown(wait=False, cancel_futures=True)
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------- the loop
    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = self._wake or asyncio.Event()
            self._lock = self._lock or asyncio.Lock()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending and not self._aborts and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
            async with self._lock:
                self._apply_aborts()
                self._admit()
                if not self.engine.has_unfinished():
                    continue
                self._update_shift()
                t0 = time.perf_counter()
                try:
                    outs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # a broken round: fail every active request, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(f"engine error: {type(e).__name__}: {e}")
                    continue
                dt = time.perf_counter() - t0
            self._account(outs, dt)
            for o in outs:
                self._dispatch(o)

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        ids, self._aborts = self._aborts, set()
        if self._pending:
            self._pending = collections.deque(lv for lv in self._pending if lv.rid not in ids)
        for rid in ids:
            self.engine.abort(rid)  # frees the KV slot and the draft state
            self._prev_stats.pop(rid, None)

    def _admit(self) -> None:
        while self._pending and self.engine.num_active() < self.opts.max_batch:
            lv = self._pending.popleft()
            if lv.rid not in self._live:  # caller already gone
                continue
            a = lv.args
            try:
                params = SamplingParams(temperature=float(a.get("temperature", 0.0) or 0.0),
                                        top_p=float(a.get("top_p", 1.0) if a.get("top_p") is not None else 1.0),
                                        top_k=int(a.get("top_k") or 0), seed=a.get("seed"))
                self.engine.add_request(list(a["prompt_ids"]), params, max_tokens=int(a.get("max_tokens") or 16),
                                        stop=a.get("stop") or None, stop_token_ids=a.get("stop_token_ids") or None,
                                        ignore_eos=bool(a.get("ignore_eos", False)), request_id=lv.rid,
                                        logprobs=a.get("logprobs"))
            except Exception as e:  # bad arguments (the ingress validates; this is the last line of defence)
                lv.finished = True
                self._totals["rejected"] += 1
                lv.queue.put_nowait({"error": str(e), "status": 400, "finished": True, "replica": self.replica_id})
                continue
            lv.admitted = True
            self._prev_stats[lv.rid] = (0, 0, False)

    def _update_shift(self) -> None:
        route = self._route if time.time() - self._route_ts <= self.opts.route_ttl_s else {}
        self._cluster_load = float(route.get("cluster_load", 0.0) or 0.0)
        if self.load_sched is None:
            return
        others_b = sum(int(t or 0) for r, t in (route.get("tokens_by_replica") or {}).items()
                       if r != self.replica_id)
        others_tau = sum(float(t or 0) for r, t in (route.get("emitted_by_replica") or {}).items()
                         if r != self.replica_id)
        f = self.opts.shared_hardware
        self.load_sched.set_load(round(f * others_b), f * others_tau)

    def _account(self, outs, dt: float) -> None:
        B, emitted = 0, 0
        for o in outs:
            st = o.stats
            rounds0, verified0, _ = self._prev_stats.get(o.request_id, (0, 0, False))
            if st.rounds > rounds0:  # a verification round: 1 + L tokens in the forward
                L = st.verified - verified0
                B += 1 + L
                if L < len(self._depth_hist):
                    self._depth_hist[L] += 1
            else:  # prefill
                B += len(o.prompt_ids)
            emitted += len(o.new_ids)
            if o.finished:
                self._prev_stats.pop(o.request_id, None)
                self._totals["finished"] += 1
                self._totals["rounds"] += st.rounds
                self._totals["accepted_tokens"] += st.accepted
                self._totals["verified_tokens"] += st.verified
                self._totals["emitted_tokens"] += st.emitted
            else:
                self._prev_stats[o.request_id] = (st.rounds, st.verified, True)
        self._totals["output_tokens"] += emitted
        self._totals["steps"] += 1
        self._tokens_last_round = B
        self._emitted_last_round = emitted
        self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
        self._recent.append((time.perf_counter(), dt, emitted, B))

    def _dispatch(self, o) -> None:
        lv = self._live.get(o.request_id)
        if lv is None:  # consumer gone; _apply_aborts frees it (finished ones are already freed)
            if not o.finished:
                self._aborts.add(o.request_id)
            return
        ids = lv.coalescer.add(o.new_ids, o.finished, o.new_logprobs)
        if ids is None:
            return  # coalesced into a later event
        ev = {"replica": self.replica_id, "token_ids": ids, "finished": o.finished}
        if o.new_logprobs is not None:
            ev["logprobs"] = lv.coalescer.sent_logprobs  # [(logprob, [(id, logprob)] * k)] per id
        if o.finished:
            text = o.text or ""
            ev["text"] = text[lv.sent_chars:]
            lv.sent_chars = len(text)
            ev.update(finish_reason=o.finish_reason, stop_reason=o.stop_reason, prompt_tokens=len(o.prompt_ids),
                      completion_tokens=len(o.output_ids), stats=_stats_dict(o.stats),
                      cluster_load=self._cluster_load,
                      load_shift=self.load_sched.base_tokens if self.load_sched is not None else 0,
                      scheduler=self.opts.scheduler if self.opts.speculative else "none", routing=lv.routing)
            lv.finished = True
        else:
            text = self.tokenizer.decode(o.output_ids, skip_special_tokens=True)
            safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD: wait for more
            end = safe - lv.hold
            ev["text"] = text[lv.sent_chars:end] if end > lv.sent_chars else ""
            lv.sent_chars = max(lv.sent_chars, end)
        lv.queue.put_nowait(ev)

    def _fail_all(self, msg: str) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._prev_stats.pop(rid, None)
            lv = self._live.get(rid)
            if lv is not None:
                lv.finished = True
                lv.queue.put_nowait({"error": msg, "status": 500, "finished": True, "replica": self.replica_id})


DSparkEngine = serve.deployment(EngineReplica, name="DSparkEngine")
