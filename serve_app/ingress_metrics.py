"""Prometheus metrics of the OpenAI ingress (serve_app/api.py), rendered by prometheus_client for GET /metrics.

Two groups of series:
  * the ingress's own, in instruments on a private registry (``IngressMetrics``): requests by endpoint and status,
    requests in flight, client disconnects, prompt/output tokens, output tokens/s over the last 10 s, τ and mean
    verified depth over completed requests, time to first token and request latency histograms;
  * per replica, rebuilt at every scrape from the routers' cluster view (``serve_app.router.cluster_view()``: the
    replicas' routing stats, at most one stats period old) by ``ReplicaViewCollector``.
"""
from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes
TOKENS_PER_S_WINDOW = 10.0
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class IngressMetrics:
    def __init__(self, model: str):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspark_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("dspark_requests_in_flight", "requests being served by this ingress", registry=r)
        self.disconnects = Counter("dspark_client_disconnects_total", "streams cancelled by the client", registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens_total", "prompt tokens", registry=r)
        self.output_tokens = Counter("dspark_output_tokens_total", "generated tokens", registry=r)
        Gauge("dspark_output_tokens_per_second", "generated tokens/s over the last 10 s (this ingress)",
              registry=r).set_function(self.tokens_per_s)
        self.acceptance_length = Gauge("dspark_acceptance_length", "tokens per verification round (tau) over "
                                       "completed requests", ["model"], registry=r).labels(model)
        self.mean_verified_depth = Gauge("dspark_mean_verified_depth", "drafts verified per round over completed "
                                         "requests", ["model"], registry=r).labels(model)
        self.accepted_tokens = Counter("dspark_accepted_tokens_total", "accepted draft tokens (completed requests)",
                                       registry=r)
        self.ttft = Histogram("dspark_ttft_seconds", "time to first token (ingress)", buckets=TTFT_BUCKETS,
                              registry=r)
        self.latency = Histogram("dspark_request_latency_seconds", "request latency (ingress)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self._rounds = self._emitted = self._verified = 0
        self._recent = collections.deque(maxlen=4096)  # (monotonic time, output tokens)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def tokens(self, n: int) -> None:
        if n:
            self.output_tokens.inc(n)
            self._recent.append((time.monotonic(), n))

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in self._recent if now - t <= TOKENS_PER_S_WINDOW) / TOKENS_PER_S_WINDOW

    def finish(self, prompt_tokens: int, latency_s: float, stats: dict | None) -> None:
        """A request completed: its prompt size, latency and the engine's speculation stats (serve_app/replica.py)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.latency.observe(latency_s)
        if not stats:
            return
        self._rounds += stats.get("rounds", 0)
        self._emitted += stats.get("emitted_tokens", 0)
        self._verified += stats.get("verified_tokens", 0)
        self.accepted_tokens.inc(stats.get("accepted_tokens", 0))
        if self._rounds:
            self.acceptance_length.set(self._emitted / self._rounds)
            self.mean_verified_depth.set(self._verified / self._rounds)

    def exposition(self, view: dict) -> bytes:
        """The Prometheus text of this ingress plus the per-replica series of ``view`` {replica id: stats}."""
        return generate_latest(self.registry) + generate_latest(ReplicaViewCollector(view))


# (metric, help, key in the replica's stats); gauges with one "replica" label, absent values skipped
_REPLICA_GAUGES = (
    ("dspark_replica_active_requests", "requests in the engine batch", "active"),
    ("dspark_replica_queue_depth", "requests waiting for a batch slot", "queued"),
    ("dspark_replica_router_inflight", "requests this router has in flight on the replica", "router_inflight"),
    ("dspark_replica_tokens_last_round", "target tokens in the replica's last forward", "tokens_last_round"),
    ("dspark_replica_step_seconds", "recent engine step time (EMA)", "step_s"),
    ("dspark_replica_steps_per_second", "engine steps/s over the last 5 s", "steps_per_s"),
    ("dspark_replica_tokens_per_second", "tokens/s over the last 5 s", "tokens_per_s"),
    ("dspark_replica_load_shift", "other replicas' tokens added to B in SPS(B)", "load_shift"),
    ("dspark_replica_cluster_load", "cluster load factor the replica last saw", "cluster_load"),
    ("dspark_replica_cost_scale", "measured / profiled target step time (EMA)", "cost_scale"),
)
_REPLICA_TOTALS = ("requests", "finished", "aborted", "rejected", "output_tokens", "steps", "rounds",
                   "accepted_tokens", "verified_tokens", "emitted_tokens")


class ReplicaViewCollector:
    """A prometheus_client collector over one cluster view {replica id: routing stats} (a snapshot per scrape)."""

    def __init__(self, view: dict):
        self.view = dict(sorted(view.items()))

    def collect(self):
        for name, help_, key in _REPLICA_GAUGES:
            fam = GaugeMetricFamily(name, help_, labels=["replica"])
            for rid, st in self.view.items():
                if st.get(key) is not None:
                    fam.add_metric([rid], st[key])
            if fam.samples:
                yield fam
        if not self.view:
            return
        totals = CounterMetricFamily("dspark_replica_total", "replica counters", labels=["replica", "counter"])
        skipped = CounterMetricFamily("dspark_replica_skipped_drafts_total", "rounds in which drafting was skipped",
                                      labels=["replica"])
        depth = HistogramMetricFamily("dspark_verified_depth", "drafts verified per round (replica)",
                                      labels=["replica"])
        sps = GaugeMetricFamily("dspark_sps", "profiled target steps/s for B tokens per forward",
                                labels=["replica", "batch_tokens"])
        draft = GaugeMetricFamily("dspark_draft_round_seconds", "measured drafting round time for R requests (EMA)",
                                  labels=["replica", "requests"])
        for rid, st in self.view.items():
            for k in _REPLICA_TOTALS:
                totals.add_metric([rid, k], st.get("totals", {}).get(k, 0))
            if st.get("skipped_drafts") is not None:
                skipped.add_metric([rid], st["skipped_drafts"])
            hist = st.get("depth_hist") or []  # hist[d] = rounds that verified d drafts
            if hist:
                cumulative, c = [], 0
                for d, k in enumerate(hist):
                    c += k
                    cumulative.append((str(d), c))
                depth.add_metric([rid], cumulative + [("+Inf", c)], sum(d * k for d, k in enumerate(hist)))
            for b, s in sorted((st.get("sps") or {}).items(), key=lambda kv: int(kv[0])):
                sps.add_metric([rid, str(b)], s)
            live = st.get("live_cost") or {}
            for n, sec in sorted((live.get("draft_s") or {}).items(), key=lambda kv: int(kv[0])):
                draft.add_metric([rid, str(n)], sec)
        for fam in (totals, skipped, depth, sps, draft):
            if fam.samples:
                yield fam
