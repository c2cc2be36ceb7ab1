"""The ONE place that owns the runtime environment of every entry point and test.

* loopback only: Ray, Ray Serve, Mooncake and the dashboard bind to 127.0.0.1, metadata probes are blocked by a dead
  proxy, usage stats are off;
* vLLM on CPU: KV-cache size, cache/temp folders inside the project's work folder, offline hub;
* ``init_ray(address)``: a local ``ray.init()`` or a connection to an existing cluster (``ray job submit`` sets
  RAY_ADDRESS, which wins).

Call :func:`apply_env` before importing ray / vllm / mooncake (``jobs`` and ``tests/conftest.py`` do it first thing).
"""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # pipeline/core/runtime.py -> the repository
LOOPBACK = "127.0.0.1"
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MOONCAKE_PROTOCOL_ENV = "DSPARK_MOONCAKE_PROTOCOL"  # how the chosen Mooncake protocol reaches the store clients


def work_dir() -> Path:
    """The project's ignored work folder (artifacts, caches); override with DSPARK_WORK_DIR."""
    p = Path(os.environ.get("DSPARK_WORK_DIR", PROJECT_ROOT / "work")).resolve()
    p.mkdir(parents=True, exist_ok=True)
    return p


# Environment every process must see.  setdefault semantics: an explicit user setting wins, except for the
# loopback/proxy settings that keep traffic on this machine, which are forced.
_FORCED = {
    # Ray: keep node IP and GCS on 127.0.0.1, no usage reporting, no cloud metadata probes.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_USAGE_STATS": "1",
    # A dead proxy on loopback blocks any outbound HTTP (metadata probes); loopback itself bypasses it.
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    # Mooncake transfer engine: TCP on loopback.
    "MC_TCP_BIND_ADDRESS": LOOPBACK,
    # No hub downloads, ever.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    # vLLM's CPU backend "auto" binding reserves a core for its scheduler and pins OpenMP to the rest: on a machine
    # with few cores that leaves OpenMP a fraction of them (measurements: docs/results/data_stages.md).
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_TARGET_DEVICE": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "RAY_DEDUP_LOGS": "1",
    # Ray starts its workers at nice 15 so that the raylet and GCS stay responsive; an engine replica (a worker) then
    # yields both cores to every burst of the raylet, GCS, dashboard agent or a client on the same node, and each of
    # the hundreds of OpenMP regions of a forward waits for the preempted thread (measurements:
    # docs/results/load_test.md).  The same priority as everything else on the node instead.
    "RAY_worker_niceness": "0",
    "RAY_SERVE_HTTP_HOST": LOOPBACK,
    # Serve's proxy must answer its readiness check within 5 s by default; on a busy machine with few cores it can take
    # longer, and serve.start() then fails ("ProxyActor died").  Generous limits, same behaviour otherwise.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
    # glibc malloc: back large allocations with transparent huge pages (where THP is "madvise", only memory that
    # asks gets them).  PyTorch allocates most activations fresh, so every new 4 KiB page pays a first-touch fault;
    # one fault per 2 MiB page makes a fresh allocation cost close to refilling resident memory.  Read once when a
    # process starts, so it reaches Ray workers and actors through the environment; `reexec_for_process_env()` gives
    # it to a job's own process.  (measurements: docs/results/training.md)
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    # Ray 2.60 defaults to token auth for clusters started with `ray start`; the CLI must agree.
    "RAY_AUTH_MODE": "token",
}


def apply_env() -> None:
    """Set the loopback / offline / CPU environment for this process and its children (idempotent)."""
    os.environ.update(_FORCED)
    for k, v in _DEFAULTS.items():
        os.environ.setdefault(k, v)
    wd = work_dir()
    for var, sub in (("VLLM_CACHE_ROOT", "cache/vllm"), ("TMPDIR", "tmp"), ("HF_HOME", "cache/hf")):
        if var not in os.environ:
            d = wd / sub
            d.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(d)


# Settings the C runtime reads once, when a process starts: setting them in os.environ only reaches children.
_START_ONLY = ("GLIBC_TUNABLES",)


def _environment_at_start() -> dict[str, str]:
    """This process's environment as it was at exec time (Linux: /proc/self/environ); {} where unreadable."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def reexec_for_process_env() -> None:
    """Apply the environment, then restart this process once (same interpreter and command line) if a start-only
    setting (glibc malloc tunables) differs from what the process started with.  For ``__main__`` blocks of jobs
    and scripts that compute in their own process; never call it from library code or tests.  No-op where
    /proc is missing, after one restart, or with DSPARK_NO_REEXEC=1."""
    import sys

    apply_env()
    if os.environ.get("DSPARK_NO_REEXEC") == "1" or os.environ.get("_DSPARK_REEXECED") == "1":
        return
    start = _environment_at_start()
    if not start or all(start.get(k) == os.environ.get(k) for k in _START_ONLY):
        return
    os.environ["_DSPARK_REEXECED"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, list(sys.orig_argv))


def run_job_main(main) -> None:
    """The ``if __name__ == "__main__":`` block of a job: ``reexec_for_process_env()`` (the start-only settings,
    malloc tunables, for this process too), then ``main()`` with the command line."""
    reexec_for_process_env()
    main()


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = False,
             resources: dict | None = None, **kwargs):
    """Start (or connect to) Ray with loopback settings.

    ``address``: None -> RAY_ADDRESS if set (``ray job submit``) else a new local cluster; "auto" or "host:port" ->
    connect.  Returns the ``ray`` module.

    The new local cluster is asked for as ``address="local"``: with no address, ``ray.init`` would instead join the
    cluster named in ``<temp>/ray/ray_current_cluster``, which ``ray start`` and Ray's test clusters write -- another
    user's cluster while it runs, and after one was killed without ``ray stop`` a dead address that ``ray.init``
    retries without end, so no job could start."""
    apply_env()
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True, **kwargs)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=dashboard,
            dashboard_host=LOOPBACK,
            _node_ip_address=LOOPBACK,
            resources=resources,
            log_to_driver=True,
            **kwargs,
        )
    return ray


def ray_start_head_command(port: int = 6379, dashboard_port: int = 8265, resources: dict | None = None) -> list[str]:
    """The `ray start --head` command line that keeps a cluster on loopback (used by tests and documented)."""
    import json

    cmd = ["ray", "start", "--head", f"--port={port}", f"--node-ip-address={LOOPBACK}",
           f"--dashboard-host={LOOPBACK}", f"--dashboard-port={dashboard_port}", "--disable-usage-stats"]
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    return cmd


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX).  Without it, bf16 GEMMs are emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_compute_dtype() -> str:
    """Compute precision for target engines when the user says ``auto``: bf16 on a GPU or a CPU with native bf16,
    else fp32: without native bf16 the CPU emulates bf16 GEMMs, and vLLM generates several times slower in bf16 than
    in fp32 (python -m jobs.bench vllm_dtype; measurements: docs/results/data_stages.md).  Stored hidden states are
    bf16 either way."""
    try:
        import torch

        if torch.cuda.is_available():
            return "bfloat16"
    except ImportError:  # pragma: no cover
        pass
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def resolve_device(spec: str | None = "auto") -> str:
    """``auto`` -> ``cuda`` when PyTorch sees a GPU, else ``cpu``; anything else is passed through (``cuda:1``)."""
    if spec in (None, "", "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return spec


def torch_threads(n: int | None = None) -> None:
    """Pin torch intra-op threads (default: all cores of this machine, at most 16)."""
    import torch

    torch.set_num_threads(n or min(16, os.cpu_count() or 1))
