"""A server that is starting, or whose replicas are all down, says so and never hangs a request.

Real Ray Serve on the session's local cluster, real HTTP on 127.0.0.1, the real SmolLM2 target and a random-weight
DSpark drafter.  An engine replica is held at start-up the way a real start holds it: another process owns the
SPS profile lock (a co-located replica profiling), so the replica waits in its constructor.

  * while no replica is ready: GET /health is 503 and says "0 of 1"; GET /livez is 200; a chat request gets a 503
    naming the reason within the configured --ready-wait-s (plus the time to answer), never an open-ended wait;
  * once the lock is released the replica profiles and starts: /health 200, the same request 200;
  * while the only engine replica is down (its process killed) until Serve has started a new one: /health 503, a
    request 503 within the bound; then 200 again;
  * a replica that cannot initialize within --replica-init-timeout-s fails with ReplicaInitTimeout naming its stage,
    Serve gives up on the deployment, and ``deploy`` (what jobs.serve runs) raises NotReady with that message.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.slow

PROFILE = [1, 2]  # a short SPS profile: the replica starts in seconds once it may profile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def drafter(target_dir, tmp_path_factory):
    from toy_drafter import export_random_drafter

    return export_random_drafter(target_dir, tmp_path_factory.mktemp("drafter") / "drafter")


@pytest.fixture
def serve_cluster(ray_session):
    from ray import serve

    yield
    serve.shutdown()


def _held_profile_lock(cache_dir, release: threading.Event, held: threading.Event):
    """Hold the SPS profile lock (as a co-located profiling replica would) until ``release`` is set."""
    from pipeline.core.file_lock import file_lock
    from pipeline.engine.cost_table import PROFILE_LOCK

    with file_lock(cache_dir / PROFILE_LOCK):
        held.set()
        release.wait(600)


def _config(drafter, target_dir, tmp_path, **kw):
    from serve_app.app import ServeConfig

    return ServeConfig(drafter=str(drafter), target=str(target_dir), replicas=1, port=_free_port(), threads=1,
                       scheduler="hardware", profile_batch_sizes=PROFILE, cache_dir=str(tmp_path / "cache"),
                       app_name="readiness", **kw)


def test_health_and_requests_before_and_after_the_first_ready_replica(serve_cluster, drafter, target_dir, tmp_path):
    import requests
    from ray import serve
    from ray.serve.api import RunTarget

    from serve_app.app import build_app

    cfg = _config(drafter, target_dir, tmp_path, ready_wait_s=2.0)
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_held_profile_lock, args=(tmp_path / "cache", release, held), daemon=True)
    holder.start()
    assert held.wait(10)
    base = f"http://127.0.0.1:{cfg.port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.port})
        serve.run_many([RunTarget(target=build_app(cfg), name=cfg.app_name, route_prefix="/")],
                       wait_for_applications_running=False)
        # The ingress (no model, starts in seconds) comes up; the engine replica waits on the lock.  Until the
        # ingress is up, Serve's proxy holds a request for it.
        health = requests.get(base + "/health", timeout=120)
        assert health is not None and health.status_code == 503, health and health.text
        h = health.json()
        assert h["status"] == "starting" and h["ready_replicas"] == 0 and h["wanted_replicas"] == 1
        assert "0 of 1 engine replicas ready" in h["detail"]
        assert requests.get(base + "/livez", timeout=10).status_code == 200

        body = {"model": cfg.served_model_name(str(target_dir)), "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4}
        t0 = time.monotonic()
        r = requests.post(base + "/v1/chat/completions", json=body, timeout=60)
        waited = time.monotonic() - t0
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "no_replica_ready" and "0 of 1 engine replicas ready" in err["message"]
        assert 2.0 <= waited < 2.0 + 8.0  # the configured bound, plus the time to answer

        release.set()  # the replica may profile now, and starts
        deadline = time.time() + 300
        while time.time() < deadline and requests.get(base + "/health", timeout=10).status_code != 200:
            time.sleep(0.5)
        h = requests.get(base + "/health", timeout=10)
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["ready_replicas"] == 1
        r = requests.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        release.set()
        holder.join(10)


def test_a_replica_that_cannot_initialize_fails_by_name(serve_cluster, drafter, target_dir, tmp_path):
    from serve_app.app import deploy
    from serve_app.readiness import NotReady

    cfg = _config(drafter, target_dir, tmp_path, replica_init_timeout_s=3.0, ready_timeout_s=240.0)
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_held_profile_lock, args=(tmp_path / "cache", release, held), daemon=True)
    holder.start()
    assert held.wait(10)
    said = []
    try:
        t0 = time.monotonic()
        with pytest.raises(NotReady) as e:
            deploy(cfg, report=said.append)
        took = time.monotonic() - t0
    finally:
        release.set()
        holder.join(10)
    msg = str(e.value)
    assert "failed to deploy" in msg and "did not initialize within 3 s" in msg, msg
    assert "; it was " in msg and took < 240  # the stage it was stuck in (the lock wait, or earlier on a slow machine)
    assert any("GET /health: 503 until" in s for s in said)


def _engine_replica_pids(app: str) -> list[int]:
    import psutil

    mark = f"ServeReplica:{app}:DSparkEngine"
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"]) if mark in " ".join(p.info["cmdline"] or [])]


def test_requests_while_every_replica_is_down_get_a_bounded_503(serve_cluster, drafter, target_dir, tmp_path):
    import signal

    import requests

    from serve_app.app import deploy

    cfg = _config(drafter, target_dir, tmp_path, ready_wait_s=2.0)
    deploy(cfg, report=lambda _: None)
    base = f"http://127.0.0.1:{cfg.port}"
    body = {"model": cfg.served_model_name(str(target_dir)), "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4}
    assert requests.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    (pid,) = _engine_replica_pids(cfg.app_name)
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 60
    while time.time() < deadline and requests.get(base + "/health", timeout=30).status_code != 503:
        time.sleep(0.2)
    h = requests.get(base + "/health", timeout=30)
    assert h.status_code == 503 and h.json()["ready_replicas"] == 0, h.text
    t0 = time.monotonic()
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=60)
    waited = time.monotonic() - t0
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_ready", r.text
    assert waited < 2.0 + 8.0
    deadline = time.time() + 300  # Serve starts a new replica (the SPS table is cached now)
    while time.time() < deadline and requests.get(base + "/health", timeout=30).status_code != 200:
        time.sleep(0.5)
    assert requests.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    assert _engine_replica_pids(cfg.app_name) != [pid]
