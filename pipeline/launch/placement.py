"""Where each stage runs: Ray custom resources name the node roles of the reference deployment, Ray's GPU resource
the accelerators.

    inference node:  ray start ... --resources '{"inference": N}' [--num-gpus G]   hosts N vLLM engines
                                                                                (generate / extract / serve)
    training node:   ray start ... --resources '{"training": M}' [--num-gpus G]    hosts M Ray Train workers

Every placed actor asks for ONE unit of its role's resource, so a node declared with ``inference: 1`` holds exactly one
vLLM engine (the reference ran one per inference node).  Default rule (``auto``): if the cluster declares the role at
all, actors of that role must run on such nodes; if it does not (a laptop, a single node), no constraint - the same
command works on both.  An explicit JSON object overrides the rule; ``{}`` switches placement off.

GPUs come next to the role: an engine actor with ``--gpus-per-actor g`` also asks for ``num_gpus=g``, so it lands on
a node that has both a free role unit and g free GPUs (Ray takes one actor's resources from ONE node, so a
tensor-parallel engine over N GPUs needs a node with N).  Two inference nodes with one GPU each and
``--pool-size 2 --gpus-per-actor 1`` give one engine per node; a node with 8 GPUs declared ``inference: 8`` holds
eight single-GPU engines.  ``--dry-run`` prints both parts (pipeline/launch/launch_plan.py).
"""
from __future__ import annotations

import json

INFERENCE = "inference"
TRAINING = "training"


def parse_resources(spec: str | dict | None, flag: str = "resources") -> dict | None:
    """``None``/``"auto"`` -> None (use the default rule); a JSON object -> dict of resource -> amount."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        return None
    if isinstance(spec, dict):
        obj = spec
    else:
        try:
            obj = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{flag}: not a JSON object ({e.msg}): {spec!r}") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                                            for k, v in obj.items()):
        raise ValueError(f"--{flag}: expected a JSON object of resource name -> non-negative number, got {spec!r}")
    return {k: float(v) for k, v in obj.items()}


def role_resources(role: str, spec: str | dict | None = None, flag: str = "resources") -> dict:
    """Extra Ray resources for one actor of ``role`` (call after ray.init): the explicit ``spec`` if given, else
    ``{role: 1}`` when the cluster declares ``role``, else ``{}``."""
    explicit = parse_resources(spec, flag)
    if explicit is not None:
        return explicit
    import ray

    return {role: 1.0} if ray.cluster_resources().get(role, 0) > 0 else {}


def planned_role_resources(role: str, spec: dict | None) -> dict:
    """The role part of one actor's Ray resources as the launch will request it, without connecting to the cluster
    (for ``--dry-run``): an explicit ``spec`` is exact; ``auto`` asks for one unit of ``role`` when the cluster
    declares it, which is known only once connected."""
    if spec is not None:
        return {"rule": "explicit", "resources": dict(spec)}
    return {"rule": "auto", "resources": {role: 1.0}, "applies_when": f"the cluster declares {role!r}",
            "otherwise": {}}
