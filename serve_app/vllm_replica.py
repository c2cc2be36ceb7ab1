"""vLLM engine replica: one Ray Serve replica = vLLM's AsyncLLM (target + DSpark speculator through
``speculative_config={"method": "dspark", ...}``) on ``tensor_parallel_size`` GPUs, with the interface of the native
replica (serve_app/replica.py), so the load-aware router (serve_app/router.py) and the OpenAI ingress
(serve_app/api.py) serve it unchanged.

Interface (the same events as EngineReplica)
  * ``generate(request, _route)``: streaming; events ``{"replica", "token_ids", "text", "finished"}`` as
    serve_app/events.py coalesces vLLM's outputs (the first token at once, then every ``stream_interval`` tokens);
    the last one adds finish_reason, prompt/completion token counts
    and ``stats`` (vLLM's per-request speculative counters, ``per_request_spec_decode_metrics="summary"``:
    verify steps, proposed and accepted draft tokens, acceptance length including the bonus token).
    Continuous batching, the waiting queue, aborts (a cancelled stream aborts its vLLM request) and stop strings
    are vLLM's own.
  * ``record_routing_stats()``: what the router places by -- active requests (``queued`` = those beyond
    ``max_num_seqs``, waiting in vLLM's scheduler), the recent engine step time (EMA of the gaps between
    consecutive outputs while busy; vLLM emits once per step), tokens of the last step; plus totals.

Verification depth on this engine (docs/serving_on_gpu.md)
  vLLM decides it, per engine step, for the whole batch: with ``enable_adaptive_verification`` (our schedulers
  ``hardware`` / ``async``) its AdaptiveVerificationManager ranks every (request, draft position) slot by its
  survival probability (the running product of the confidence head's per-position outputs from the previous step)
  and admits the top-k, k chosen to maximise (expected emitted tokens) / (draft cost(requests) + verify
  cost(tokens)) on step-cost curves profiled at start-up -- Algorithm 1's objective on one engine's batch, one step
  lagged like our ``async``.  Without it (``fixed``) every request verifies ``num_speculative_tokens`` drafts.
  The router's cluster view (``_route``) is recorded and reported but does not reach vLLM's budget: each vLLM
  replica owns its GPUs, which is our ``shared_hardware=0`` case (B_0 = τ_0 = 0), where our rule IS per-engine
  Algorithm 1.  Our ``token_budget`` cap and the STS temperatures have no vLLM counterpart (it uses raw
  confidences).
"""
from __future__ import annotations

import collections
import logging
import os
import time
import uuid
from dataclasses import dataclass

from ray import serve

from pipeline.core.runtime import apply_env
from serve_app.events import EventCoalescer

logger = logging.getLogger("ray.serve")

SAME_STEP_S = 0.002  # outputs of different requests closer than this came from one engine step


@dataclass
class VLLMReplicaOptions:
    """Constructor argument of a vLLM replica (built by serve_app.app.vllm_replica_options)."""

    engine_kwargs: dict  # AsyncEngineArgs(**engine_kwargs), incl. speculative_config
    engine_env: dict  # set before vLLM is imported (VLLM_TARGET_DEVICE=cuda, ...)
    model_name: str = "model"
    max_batch: int = 8  # = engine_kwargs["max_num_seqs"]
    scheduler: str = "hardware"
    stream_interval: int = 1  # tokens per streamed event after the first (as serve_app/replica.py)

    @property
    def num_speculative_tokens(self) -> int:
        return int((self.engine_kwargs.get("speculative_config") or {}).get("num_speculative_tokens", 0))


def sampling_kwargs(request: dict) -> dict:
    """vLLM SamplingParams keyword arguments of one request (the ingress validated the values)."""
    stop = request.get("stop") or []
    return dict(max_tokens=int(request.get("max_tokens") or 16),
                temperature=float(request.get("temperature", 0.0) or 0.0),
                top_p=float(request.get("top_p") if request.get("top_p") is not None else 1.0),
                top_k=int(request.get("top_k") or 0), seed=request.get("seed"),
                stop=[stop] if isinstance(stop, str) else list(stop),
                stop_token_ids=list(request.get("stop_token_ids") or []),
                ignore_eos=bool(request.get("ignore_eos", False)),
                repetition_penalty=float(request.get("repetition_penalty") or 1.0),
                logprobs=request.get("logprobs"))


def event_logprobs(ids: list, logprobs, k: int) -> list:
    """vLLM's per-token {id: Logprob} dicts -> ours: [(logprob of the id, [(id, logprob)] * k best)] per id."""
    out = []
    for tid, d in zip(ids, logprobs or []):
        best = sorted(((i, lp) for i, lp in d.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)
        out.append((float(d[tid].logprob), [(int(i), float(lp.logprob)) for i, lp in best[:k]]))
    return out


def spec_stats(metrics, completion_tokens: int) -> dict:
    """Our per-request stats dict from vLLM's RequestSpecDecodeMetrics (None without speculation)."""
    d = metrics.to_dict() if hasattr(metrics, "to_dict") else dict(metrics or {})
    rounds = int(d.get("num_spec_steps", 0))
    accepted = int(d.get("num_accepted_draft_tokens", 0))
    return {"rounds": rounds, "proposed_tokens": int(d.get("num_draft_tokens", 0)),
            "verified_tokens": int(d.get("num_draft_tokens", 0)), "accepted_tokens": accepted,
            "emitted_tokens": completion_tokens,
            "mean_verified_depth": d.get("num_draft_tokens", 0) / rounds if rounds else 0.0,
            "acceptance_length": float(d.get("mean_acceptance_length", 0.0)) if rounds else 0.0,
            "accepted_hist": list(d.get("acceptance_histogram") or [])}


class VLLMEngineReplica:
    """The vLLM engine deployment class (decorated below).  Constructor arg: ``VLLMReplicaOptions`` as a dict."""

    def __init__(self, options: dict):
        apply_env()
        self.opts = opts = VLLMReplicaOptions(**options)
        os.environ.update(opts.engine_env)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = f"local-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**opts.engine_kwargs))
        self.load_s = time.perf_counter() - t0
        self._active = 0
        self._route: dict = {}
        self._cluster_load = 0.0
        self._step_ema: float | None = None
        self._last_out: float | None = None
        self._step_tokens = 0  # tokens of the step being collected
        self._tokens_last_round = 0
        self._recent: collections.deque = collections.deque(maxlen=512)  # (t, tokens)
        self._totals = collections.Counter()
        self._accepted_hist = [0] * (opts.num_speculative_tokens + 1)
        logger.info("vLLM replica %s ready in %.1fs (scheduler=%s, num_speculative_tokens=%s)", self.replica_id,
                    self.load_s, opts.scheduler, opts.num_speculative_tokens)

    # ------------------------------------------------------------------------------------------- public methods
    async def generate(self, request: dict, _route: dict | None = None):
        """Stream events for one request (see the module docstring); ``_route`` is injected by the router."""
        import vllm.exceptions
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # errors caused by the request (vLLM's own 4xx class where this vLLM has one)
        client_errors = (TypeError, ValueError, getattr(vllm.exceptions, "VLLMClientError", ValueError))

        if _route:
            self._route = dict(_route)
            self._cluster_load = float(_route.get("cluster_load", 0.0) or 0.0)
        rid = str(request.get("request_id") or f"req-{uuid.uuid4().hex[:12]}") + f"-{uuid.uuid4().hex[:4]}"
        self._totals["requests"] += 1
        try:
            params = SamplingParams(output_kind=RequestOutputKind.DELTA, **sampling_kwargs(request))
        except client_errors as e:
            self._totals["rejected"] += 1
            yield {"error": str(e), "status": 400, "finished": True, "replica": self.replica_id}
            return
        prompt_ids = list(request["prompt_ids"])
        self._active += 1
        n_out, finished = 0, False
        coalescer = EventCoalescer(self.opts.stream_interval, request)
        unsent_text = []  # the text of the outputs the coalescer holds back
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, rid):
                c = out.outputs[0]
                ids = list(c.token_ids)
                n_out += len(ids)
                self._account(len(ids))
                unsent_text.append(c.text or "")
                lps = None if request.get("logprobs") is None else \
                    event_logprobs(list(c.token_ids), c.logprobs, int(request["logprobs"]))
                ids = coalescer.add(ids, out.finished, lps)
                if ids is None:
                    continue
                ev = {"replica": self.replica_id, "token_ids": ids, "text": "".join(unsent_text),
                      "finished": out.finished}
                if lps is not None:
                    ev["logprobs"] = coalescer.sent_logprobs
                unsent_text = []
                if out.finished:
                    finished = True
                    stats = spec_stats(getattr(c, "spec_decode_metrics", None), n_out)
                    self._finish(stats, n_out)
                    ev.update(finish_reason=c.finish_reason or "stop", stop_reason=c.stop_reason,
                              prompt_tokens=len(prompt_ids), completion_tokens=n_out, stats=stats,
                              cluster_load=self._cluster_load, load_shift=0,
                              scheduler=self.opts.scheduler, routing=(_route or {}).get("ranking"))
                yield ev
        except client_errors as e:  # vLLM's input validation (prompt too long, bad parameter)
            finished = True
            self._totals["rejected"] += 1
            yield {"error": str(e), "status": 400, "finished": True, "replica": self.replica_id}
        finally:
            self._active -= 1
            if not finished:
                self._totals["aborted"] += 1  # AsyncLLM aborted the request when the stream closed
            if self._active == 0:
                self._last_out = None  # an idle gap is not a step

    async def record_routing_stats(self) -> dict:
        """Load report polled by the Serve controller and handed to the router (``replica.routing_stats``)."""
        horizon = time.perf_counter() - 5.0
        rec = [r for r in self._recent if r[0] >= horizon]
        return {
            "replica": self.replica_id, "ts": time.time(), "engine": "vllm",
            "active": min(self._active, self.opts.max_batch), "queued": max(0, self._active - self.opts.max_batch),
            "max_batch": self.opts.max_batch,
            "tokens_last_round": self._tokens_last_round if rec else 0,
            "emitted_last_round": self._tokens_last_round if rec else 0,
            "step_s": self._step_ema, "tokens_per_s": sum(r[1] for r in rec) / 5.0,
            "cluster_load": self._cluster_load, "load_shift": 0, "scheduler": self.opts.scheduler,
            "num_speculative_tokens": self.opts.num_speculative_tokens, "totals": dict(self._totals), "accepted_hist": list(self._accepted_hist),
        }

    async def stats(self) -> dict:
        d = await self.record_routing_stats()
        d.update(model=self.opts.model_name, max_model_len=self.opts.engine_kwargs.get("max_model_len"),
                 load_s=self.load_s)
        return d

    async def check_health(self):
        await self.engine.check_health()

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------- accounting
    def _account(self, n_tokens: int) -> None:
        now = time.perf_counter()
        if self._last_out is not None and now - self._last_out > SAME_STEP_S:  # a new engine step
            dt = now - self._last_out
            self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
            self._tokens_last_round, self._step_tokens = self._step_tokens, 0
            self._totals["steps"] += 1
        self._step_tokens += n_tokens
        self._last_out = now
        self._recent.append((now, n_tokens))
        self._totals["output_tokens"] += n_tokens

    def _finish(self, stats: dict, n_out: int) -> None:
        self._totals["finished"] += 1
        for k in ("rounds", "accepted_tokens", "verified_tokens"):
            self._totals[k] += stats[k]
        self._totals["emitted_tokens"] += n_out
        for j, n in enumerate(stats["accepted_hist"][:len(self._accepted_hist)]):
            self._accepted_hist[j] += n


VLLMEngine = serve.deployment(VLLMEngineReplica, name="DSparkEngine")
