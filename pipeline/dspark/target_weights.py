"""The target's tensors a drafter takes: the frozen input embedding and (full-vocabulary) LM head it shares, and
optionally its last decoder layers as the starting point of the drafter's own layers (``load_target_layers``).

Read from a transformers module, or straight from a local HF folder's safetensors without instantiating the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class TargetWeightsError(RuntimeError):
    pass


@dataclass
class TargetWeights:
    embed: torch.Tensor  # [V, d]
    lm_head: torch.Tensor  # [V, d] (== embed when tied)
    hidden_size: int
    vocab_size: int
    num_layers: int
    name_or_path: str
    architectures: list[str]


def load_target_weights(target) -> TargetWeights:
    """`target`: a transformers causal LM (module) or a local HF folder (reads only the two tensors it needs)."""
    if isinstance(target, torch.nn.Module):
        cfg = target.config
        emb = target.get_input_embeddings().weight.detach()
        out = target.get_output_embeddings()
        head = emb if out is None else out.weight.detach()
        return TargetWeights(emb, head, int(cfg.hidden_size), int(emb.shape[0]), int(cfg.num_hidden_layers),
                             str(getattr(cfg, "_name_or_path", "") or ""), list(getattr(cfg, "architectures", None)
                                                                               or []))
    path = Path(target)
    if not (path / CONFIG_NAME).is_file():
        raise TargetWeightsError(f"target {str(target)!r} is neither a model nor a local HF folder with config.json")
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    tensors = _read_named_tensors(path, ["model.embed_tokens.weight", "lm_head.weight"])
    emb = tensors.get("model.embed_tokens.weight")
    if emb is None:  # unusual naming: fall back to instantiating the model
        from transformers import AutoModelForCausalLM

        return load_target_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    head = tensors.get("lm_head.weight", emb)
    return TargetWeights(emb, head, int(cfg["hidden_size"]), int(emb.shape[0]), int(cfg["num_hidden_layers"]),
                         str(path), list(cfg.get("architectures") or []))


def load_target_layers(target, count: int) -> dict[str, torch.Tensor]:
    """The target's last `count` decoder layers and its final norm, keyed by the drafter's parameter names:
    target layer L-count+j's ``model.layers.{L-count+j}.<rest>`` becomes ``layers.{j}.<rest>`` and ``model.norm.weight``
    becomes ``norm.weight`` (fp32 copies).  `target`: a transformers causal LM or a local HF folder."""
    state = None  # a module's tensors; a folder's are read below, only the wanted ones
    if isinstance(target, torch.nn.Module):
        L = int(target.config.num_hidden_layers)
        state = {k: v.detach() for k, v in target.state_dict().items()}
    else:
        folder = Path(target)
        cfg = json.loads((folder / CONFIG_NAME).read_text())
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
        L = int(cfg["num_hidden_layers"])
    if not 1 <= count <= L:
        raise TargetWeightsError(f"cannot initialise {count} drafter layer(s) from a target with {L} decoder layers")
    first, wanted = L - count, {}
    for n in (state if state is not None else _weight_files(folder)):
        if n == "model.norm.weight":
            wanted[n] = "norm.weight"
        elif n.startswith("model.layers."):
            idx, _, rest = n[len("model.layers."):].partition(".")
            if idx.isdigit() and int(idx) >= first and "rotary" not in rest:
                wanted[n] = f"layers.{int(idx) - first}.{rest}"
    if "model.norm.weight" not in wanted or not any(v.startswith("layers.") for v in wanted.values()):
        raise TargetWeightsError("target has no model.layers.* / model.norm.weight tensors (a Llama / Qwen-style "
                                 "causal LM is needed to initialise drafter layers from it)")
    if state is None:
        state = _read_named_tensors(folder, list(wanted))
    return {wanted[n]: state[n].float().clone() for n in wanted}


def _weight_files(folder: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a local HF folder: from a sharded folder's index, or the single file's
    header."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    f = folder / WEIGHTS_NAME
    if not f.is_file():
        raise TargetWeightsError(f"target folder {folder} has no {WEIGHTS_NAME} (or index)")
    with safe_open(str(f), framework="pt") as sf:
        return {n: f for n in sf.keys()}


def _read_named_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors the folder holds (names it lacks are left out), each file opened once."""
    from safetensors import safe_open

    wmap = _weight_files(folder)
    by_file: dict[Path, list[str]] = {}
    for n in names:
        if n in wmap:
            by_file.setdefault(wmap[n], []).append(n)
    out = {}
    for f, in_file in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            out.update({n: sf.get_tensor(n) for n in in_file})
    return out
