"""Job config fields that several jobs declare with the same meaning: one default and one help text each.

Used in the dataclass configs that ``pipeline.core.config_cli`` turns into flags, e.g.
``target: str | None = target_field()`` or ``temperature: float = temperature_field("of the rollouts")``.
The sampling fields take the words that say what is sampled, so each job's ``--help`` still says it.
"""
from __future__ import annotations

from dataclasses import field

ENGINE_DTYPES = ["auto", "float32", "bfloat16", "float16"]


def target_field():
    """``--target``: the target model's folder (None = the prepared SmolLM2-135M, pipeline.data.target_model)."""
    return field(default=None, metadata={"help": "target HF folder (default: prepared SmolLM2-135M)"})


def temperature_field(of: str):
    """``--temperature`` of the sampling ``of`` names (0 = greedy, as pipeline.ops.sampling.SamplingParams)."""
    return field(default=0.0, metadata={"help": f"sampling temperature {of} (0 = greedy)"})


def top_p_field(of: str):
    """``--top-p`` of the sampling ``of`` names (1 = off)."""
    return field(default=1.0, metadata={"help": f"top-p: nucleus sampling mass {of} (1 = off)"})


def top_k_field(of: str):
    """``--top-k`` of the sampling ``of`` names (0 = off)."""
    return field(default=0, metadata={"help": f"top-k sampling {of} (0 = off)"})


def engine_dtype_field():
    """``--dtype`` of a vLLM engine actor (resolved by actors.vllm_engine.engine_dtype)."""
    return field(default="auto", metadata={
        "help": "engine compute precision; auto = bf16 on GPU / CPUs with native bf16, else fp32 (emulated bf16 is "
                "slower)",
        "choices": ENGINE_DTYPES})


def actor_threads_field():
    """``--threads`` of each vLLM actor of a pool."""
    return field(default=None, metadata={
        "help": "OpenMP/torch threads per vLLM actor (default: all cores of the node)"})


def actor_resources_field():
    """``--actor-resources`` of each actor of a pool (resolved by pipeline.launch.placement)."""
    return field(default=None, metadata={
        "help": "extra Ray resources per actor as JSON, or auto: {\"inference\": 1} when the cluster declares "
                "inference nodes, else none (see pipeline/launch/placement.py); {} = no constraint"})


def ray_address_field():
    """``--address`` of the Ray cluster a job's actors run on."""
    return field(default=None, metadata={"help": "Ray address to connect to (default: local)"})
