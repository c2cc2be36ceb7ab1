"""Whether the engine replicas can take a request: what ``GET /health`` answers, what a request waits for (at most a
bound) before the ingress gives up with 503, and what ``jobs.serve`` waits for before it says it is serving.

The source is Serve's controller (``serve.status()``): a replica counts as ready when Serve lists it RUNNING, i.e.
its constructor returned (the engine built, the SPS table profiled or loaded) and its health checks pass.  A
replica that is still starting, restarting after a crash, or failing its constructor is not ready.

    r = readiness("dspark", "DSparkEngine", wanted=2)
    r.ready            # at least one replica RUNNING
    r.describe()       # "1 of 2 engine replicas ready (1 starting)"
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

READY_STATE = "RUNNING"
FAILED_STATUSES = ("DEPLOY_FAILED",)


@dataclass
class Readiness:
    ready_replicas: int
    wanted_replicas: int
    replica_states: dict = field(default_factory=dict)  # Serve's replica state -> count (RUNNING, STARTING, ...)
    app_status: str = "NOT_STARTED"  # Serve's application status
    message: str = ""  # Serve's message on the deployment (e.g. a replica constructor's error)

    @property
    def ready(self) -> bool:
        return self.ready_replicas > 0

    @property
    def failed(self) -> bool:
        return self.app_status in FAILED_STATUSES

    def describe(self) -> str:
        others = ", ".join(f"{n} {s.lower()}" for s, n in sorted(self.replica_states.items())
                           if s != READY_STATE and n)
        text = f"{self.ready_replicas} of {self.wanted_replicas} engine replicas ready"
        text += f" ({others})" if others else ""
        if self.failed:
            text += f"; the application failed to deploy: {self.message}"
        elif not self.ready and self.message:
            text += f"; {self.message}"
        return text

    def to_dict(self) -> dict:
        return asdict(self)


def _name(x) -> str:
    return str(getattr(x, "value", x))


def readiness(app_name: str, deployment: str, wanted: int) -> Readiness:
    """The engine deployment's readiness as Serve's controller sees it now (one controller call)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None:
        return Readiness(0, wanted, {}, "NOT_STARTED", f"no Serve application {app_name!r}")
    dep = app.deployments.get(deployment)
    if dep is None:
        return Readiness(0, wanted, {}, _name(app.status), app.message)
    states = {_name(s): int(n) for s, n in dep.replica_states.items()}
    return Readiness(states.get(READY_STATE, 0), wanted, states, _name(app.status), dep.message or app.message)


class ReadinessProbe:
    """``readiness`` for the ingress: asked off the event loop, remembered for ``ttl_s`` while not ready and
    ``ttl_ready_s`` once ready (one controller call per period however many requests ask: under load the answer is
    "ready" and costs the controller one call per ``ttl_ready_s``)."""

    def __init__(self, app_name: str, deployment: str, wanted: int, ttl_s: float = 0.5, ttl_ready_s: float = 5.0):
        self.app_name, self.deployment, self.wanted = app_name, deployment, wanted
        self.ttl_s, self.ttl_ready_s = ttl_s, ttl_ready_s
        self._last: Readiness | None = None
        self._at = 0.0
        self._inflight: asyncio.Future | None = None

    async def get(self, fresh: bool = False) -> Readiness:
        """The latest readiness; ``fresh``: no older than ``ttl_s`` even when it said ready (a caller that has
        seen a sign of trouble)."""
        if self._last is not None:
            ttl = self.ttl_ready_s if self._last.ready and not fresh else self.ttl_s
            if time.monotonic() - self._at < ttl:
                return self._last
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(asyncio.to_thread(readiness, self.app_name, self.deployment,
                                                                     self.wanted))
        try:
            self._last = await asyncio.shield(self._inflight)
        except Exception as e:  # the controller unreachable: not ready, and say why
            self._last = Readiness(0, self.wanted, {}, "UNKNOWN", f"cannot reach Serve's controller: {e}")
        self._at = time.monotonic()
        return self._last


class NotReady(RuntimeError):
    """The engine replicas did not become ready in time, or the application failed to deploy."""


def wait_until_ready(app_name: str, deployment: str, wanted: int, timeout_s: float, report=print,
                     every_s: float = 10.0, poll_s: float = 0.5) -> Readiness:
    """Block until at least one engine replica is ready (returns its readiness), reporting progress every
    ``every_s``; :class:`NotReady` when the application fails to deploy or nothing is ready within ``timeout_s``."""
    t0 = time.monotonic()
    last_report = t0
    while True:
        r = readiness(app_name, deployment, wanted)
        waited = time.monotonic() - t0
        if r.ready:
            return r
        if r.failed:
            raise NotReady(f"the Serve application {app_name!r} failed to deploy after {waited:.0f} s: "
                           f"{r.describe()}")
        if waited >= timeout_s:
            raise NotReady(f"no engine replica became ready within {timeout_s:g} s (--ready-timeout-s): "
                           f"{r.describe()}")
        if time.monotonic() - last_report >= every_s:
            report(f"waiting for engine replicas: {r.describe()} ({waited:.0f} s)")
            last_report = time.monotonic()
        time.sleep(poll_s)
