"""FSDP for the drafter (jobs.train --fsdp): parameters, gradients and optimizer state sharded over the data-parallel
workers with FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of replicated on each.

Units (each all-gathers its parameters just before it runs and frees them after; gradients are reduce-scattered):

* every projection of every draft decoder layer (``self_attn.{q,k,v,o}_proj``) and every layer's MLP.  Not the
  layer as a whole: ``DSparkDrafter.forward_train`` computes a layer's context K/V with
  ``layer.self_attn.kv(H_ctx)`` BEFORE calling the layer, i.e. outside the layer's own forward, where a per-layer
  unit would still hold only its shard.  k/v_proj run twice per forward (context and block tokens), so they are
  gathered twice;
* then the drafter itself (the root unit: fc, the norms, the Markov / confidence heads and the frozen target
  embedding / LM head, sharded too - frozen parameters get no gradient and no optimizer state).  Its training
  methods ``forward_train`` and ``block_logits`` are called directly (not through ``__call__``), so they are
  registered as FSDP forward methods.

Gradients are SUMMED over the workers (divide factor 1, sum-only collectives, which gloo also speaks): every loss is
already divided by the step's GLOBAL weight sum (docs/dspark.md §5), as the DDP-equivalent path's all-reduce sums.

Checkpoints keep the replicated run's format - full (unsharded) model and optimizer state dicts, the optimizer's
keyed by parameter index - so either kind of run resumes the other's (``full_state`` / ``load_full_state``,
through ``torch.distributed.checkpoint.state_dict``).  Everything here is collective: every rank calls it.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

ROOT_FORWARD_METHODS = ("forward_train", "block_logits")  # the drafter's training-path entry points
LAYER_UNITS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp")
UNITS_SUMMARY = ("each draft decoder layer's q/k/v/o projections and MLP, then the whole drafter (fc, norms, heads, "
                 "frozen target embedding / LM head)")


def shard_drafter(model: nn.Module, device: torch.device) -> nn.Module:
    """Apply FSDP2 to `model` (a DSparkDrafter, identical on every rank) in place over all ranks of the default
    process group; returns it.  Its parameters become DTensor shards: build the optimizer afterwards."""
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for layer in model.layers:
        for name in LAYER_UNITS:
            fully_shard(layer.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    for method in ROOT_FORWARD_METHODS:
        register_fsdp_forward_method(model, method)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, not average (module docstring)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives
    # forward_train returns a view (norm(x).view(B, S, γ, d)); FSDP warns that an in-place op on it would skip the
    # pre-backward hook. The loss only reads it (block_logits indexes it out of place).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPDSparkDrafter\) returned a view tensor")
    return model


def parameter_elements(model: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) over all parameters, frozen ones included."""
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return held, sum(p.numel() for p in model.parameters())


def _trainable_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the trainable parameters, in the optimizer's order (DSparkDrafter.
    trainable_parameters: module order, requires_grad only) -- index i of a plain optimizer state dict."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict:
    """The model's full state dict (frozen weights included) on the CPU of rank 0; {} on the other ranks."""
    return get_model_state_dict(model, options=FULL_ON_RANK0)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) gathered to full tensors on the CPU of rank 0 (the other ranks get
    empty dicts), in the format of a replicated run's ``model.state_dict()`` / ``optimizer.state_dict()``."""
    model_sd = full_model_state(model)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK0)
    if not model_sd:  # not rank 0
        return {}, {}
    index = {name: i for i, name in enumerate(_trainable_names(model))}
    optim_sd = {"state": {index[name]: s for name, s in optim_sd["state"].items()},
                "param_groups": [g | {"params": [index[name] for name in g["params"]]}
                                 for g in optim_sd["param_groups"]]}
    return model_sd, optim_sd


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load full state dicts of the replicated format (every rank holds them) into the sharded model / optimizer.
    The model's may leave out the frozen target embedding / LM head (the drafter already has them)."""
    names = _trainable_names(model)
    optim_sd = {"state": {names[int(i)]: s for i, s in optim_sd["state"].items()},
                "param_groups": [g | {"params": [names[int(i)] for i in g["params"]]}
                                 for g in optim_sd["param_groups"]]}
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))


def full_norm(total_norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a DTensor over sharded gradients)."""
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    return float(total_norm)
