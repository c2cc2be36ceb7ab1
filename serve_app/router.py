"""LoadAwareRouter: a Ray Serve ``RequestRouter`` that places each request on the replica with the least expected work
and tells the chosen replica how loaded the whole cluster is.

Placement (``choose_replicas``)
  load_i  = mine_i + others_i
            mine_i   = requests this router has sent to i and not seen complete (fresh, exact for its own traffic)
            others_i = max(0, active_i + queued_i − mine_i(t_i)) from i's routing stats taken at time t_i, minus what
                       this router itself had in flight on i at t_i: the traffic of OTHER routers (ingress replicas,
                       handles), the only part the stats know better; stale stats never resurrect our own finished
                       requests
  step_i  = i's recent engine step time (EMA, seconds per round; before any traffic the profiled t(1);
            unknown -> the median of the known ones)
  work_i  = (load_i + 1) * step_i      -- expected time for one round of everything on i, this request included
  Replicas are returned as ranks, least work first (ties: fewer requests, then random), so Serve tries the best one
  first and falls back to the next when a replica is at ``max_ongoing_requests``.  Not round-robin: with one replica
  busy, consecutive requests keep going to the idle one.

Cluster view (handed to the replica, which uses it for its verification depth -- serve_app/replica.py)
  ``pending_request.kwargs["_route"] = {"tokens_by_replica": {replica: target tokens in its last round},
  "emitted_by_replica": {replica: tokens it emitted in its last round}, "cluster_load": Σ load_i / Σ max_batch_i,
  "ts": ...}`` for calls of the engine's ``generate`` method.  Stale stats (older than ``stale_after_s``) count as
  zero.

Both engine replicas report what the placement needs: the native one (serve_app/replica.py) from its own engine
loop, the vLLM one (serve_app/vllm_replica.py) from vLLM's output stream (requests in flight, those beyond
``max_num_seqs`` as queued, the EMA of the gaps between engine steps as ``step_s``).  The vLLM replica records the
cluster view but does not feed it to vLLM's verification budget (docs/serving_on_gpu.md).

Every view is also published in-process (``cluster_view()``) for the ingress's /metrics (the router runs inside the
ingress replica, which owns the engine handle), and so is the number of running replicas the router knows
(``known_replicas()``): the ingress's first, free check that a request has somewhere to go.
"""
from __future__ import annotations

import collections
import random
import statistics
import threading
import time
from typing import Any, Dict, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

ENGINE_METHOD = "generate"

# process-wide: deployment name -> {replica_id: routing stats + router-side in-flight}
_VIEW: Dict[str, Dict[str, dict]] = {}
# process-wide: deployment name -> how many running replicas the router knows (Serve pushes every change)
_REPLICAS: Dict[str, int] = {}
_VIEW_LOCK = threading.Lock()


def cluster_view(deployment: str | None = None) -> Dict[str, dict]:
    """The latest per-replica view seen by a LoadAwareRouter in this process (copy)."""
    with _VIEW_LOCK:
        if deployment is not None:
            return {k: dict(v) for k, v in _VIEW.get(deployment, {}).items()}
        out: Dict[str, dict] = {}
        for d in _VIEW.values():
            out.update({k: dict(v) for k, v in d.items()})
        return out


def known_replicas(deployment: str) -> Optional[int]:
    """How many running replicas of ``deployment`` a LoadAwareRouter in this process knows of now (None: no
    router yet -- Serve builds it on the first request through the handle).  Serve pushes the running set to the
    router when it changes, and the router drops a replica at once when a call finds it dead."""
    with _VIEW_LOCK:
        return _REPLICAS.get(deployment)


def expected_work(load: float, step_s: float) -> float:
    return (load + 1.0) * step_s


class LoadAwareRouter(RequestRouter):
    def initialize_state(self, stale_after_s: float = 5.0, default_step_s: float = 0.05, **kwargs):
        self.stale_after_s = float(stale_after_s)
        self.default_step_s = float(default_step_s)
        self._inflight: Dict[ReplicaID, int] = {}
        self._history: Dict[ReplicaID, collections.deque] = {}  # (time, in-flight after the change)
        self._lock = threading.Lock()
        self.last_decision: Optional[dict] = None

    # ---------------------------------------------------------------- in-flight bookkeeping (router side, fresh)
    def _state_ready(self) -> bool:
        return hasattr(self, "_inflight")

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)
        if not self._state_ready():
            self.initialize_state()
        with self._lock:
            n = self._inflight.get(replica_id, 0) + 1
            self._inflight[replica_id] = n
            self._note(replica_id, n)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str):
        super().on_request_completed(replica_id, internal_request_id)
        if not self._state_ready():
            return
        with self._lock:  # may run on a Ray worker thread
            n = max(0, self._inflight.get(replica_id, 0) - 1)
            if n > 0:
                self._inflight[replica_id] = n
            else:
                self._inflight.pop(replica_id, None)
            self._note(replica_id, n)

    def _note(self, replica_id: ReplicaID, n: int) -> None:
        h = self._history.get(replica_id)
        if h is None:
            h = self._history[replica_id] = collections.deque(maxlen=256)
        h.append((time.time(), n))

    def inflight_at(self, replica_id: ReplicaID, t: float) -> int:
        """This router's in-flight count on the replica at time t (0 before any recorded change)."""
        with self._lock:
            h = self._history.get(replica_id)
            if not h:
                return 0
            n = 0
            for ts, k in h:
                if ts > t:
                    break
                n = k
            return n

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        if self._state_ready():
            with self._lock:
                self._inflight.pop(replica_id, None)
                self._history.pop(replica_id, None)
        self._publish_count(len(getattr(self, "_replicas", {})))

    # ---------------------------------------------------------------- scoring
    def _fresh_stats(self, r: RunningReplica, now: float) -> dict:
        st = r.routing_stats or {}
        ts = st.get("ts")
        if ts is None or now - float(ts) > self.stale_after_s:
            # too old for load numbers; the step time is still the best estimate there is
            return {"step_s": st.get("step_s"), "max_batch": st.get("max_batch")}
        return st

    def score(self, candidates: List[RunningReplica]) -> List[dict]:
        now = time.time()
        rows = []
        for r in candidates:
            st = self._fresh_stats(r, now)
            with self._lock:
                local = self._inflight.get(r.replica_id, 0)
            reported = int(st.get("active", 0) or 0) + int(st.get("queued", 0) or 0)
            others = max(0, reported - self.inflight_at(r.replica_id, float(st["ts"]))) if "ts" in st else 0
            rows.append({"replica": r, "id": r.replica_id.unique_id, "local": local, "reported": reported,
                         "load": local + others, "step_s": st.get("step_s"),
                         "tokens": int(st.get("tokens_last_round", 0) or 0),
                         "emitted": float(st.get("emitted_last_round", 0) or 0),
                         "max_batch": int(st.get("max_batch") or r.max_ongoing_requests or 1), "stats": st})
        known = [x["step_s"] for x in rows if x["step_s"]]
        fallback = statistics.median(known) if known else self.default_step_s
        for x in rows:
            x["step_s"] = float(x["step_s"] or fallback)
            x["work"] = expected_work(x["load"], x["step_s"])
            x["tie"] = random.random()
        rows.sort(key=lambda x: (x["work"], x["load"], x["tie"]))
        return rows

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not self._state_ready():
            self.initialize_state()
        if not candidate_replicas:
            return []
        rows = self.score(candidate_replicas)
        cap = sum(x["max_batch"] for x in rows) or 1
        route = {"tokens_by_replica": {x["id"]: x["tokens"] for x in rows},
                 "emitted_by_replica": {x["id"]: x["emitted"] for x in rows},
                 "cluster_load": sum(x["load"] for x in rows) / cap, "ts": time.time(),
                 "ranking": [{"replica": x["id"], "work": round(x["work"], 5), "load": x["load"],
                              "router_inflight": x["local"], "reported": x["reported"]} for x in rows]}
        if pending_request is not None and getattr(pending_request.metadata, "call_method", None) == ENGINE_METHOD:
            pending_request.kwargs["_route"] = route
        self.last_decision = {"ranking": [(x["id"], round(x["work"], 4), x["load"]) for x in rows]}
        self._publish(rows)
        return [[x["replica"]] for x in rows]

    def update_replicas(self, replicas: List[RunningReplica]):
        super().update_replicas(replicas)
        self._publish_count(len(replicas))
        try:
            if not self._state_ready():
                self.initialize_state()
            self._publish(self.score(list(replicas)))
        except Exception:  # publishing is best effort; routing must not fail because of it
            pass

    def _deployment_name(self) -> str:
        dep = getattr(self, "_deployment_id", None)
        return dep.name if dep is not None else "engine"

    def _publish_count(self, n: int) -> None:
        import serve_app.router as registry  # the real module's globals (see _publish)

        with registry._VIEW_LOCK:
            registry._REPLICAS[self._deployment_name()] = int(n)

    def _publish(self, rows: List[dict]) -> None:
        name = self._deployment_name()
        view = {}
        for x in rows:
            d: Dict[str, Any] = dict(x["stats"])
            d.update(router_inflight=x["local"], load=x["load"], expected_work=x["work"], step_s=x["step_s"])
            view[x["id"]] = d
        # Through the import system, not this function's globals: Serve ships the router class by value
        # (cloudpickle), so each unpickled copy has its own module globals; the ingress reads the real module's.
        import serve_app.router as registry

        with registry._VIEW_LOCK:
            registry._VIEW[name] = view
