"""Hidden-state extraction with transformers (the fallback extractor, and the reference the vLLM one is tested
against).  One forward over prompt + response; returns the chosen layers (vLLM id convention) and the final hidden
state after the final norm (the LM-head input), both bf16."""
from __future__ import annotations

from pathlib import Path

import torch


class HFExtractor:
    def __init__(self, target, layer_ids: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"):
        """target: an HF folder (loaded in `dtype` on `device`), or a causal LM already loaded (used as it is)."""
        if isinstance(target, (str, Path)):
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()
        else:
            self.model = target.eval()
            device = next(target.parameters()).device
        self.layer_ids = list(layer_ids)
        self.device = device
        self.n_layers = self.model.config.num_hidden_layers
        if self.layer_ids and (self.layer_ids[0] < 0 or self.layer_ids[-1] > self.n_layers):
            raise ValueError(f"layer ids {self.layer_ids} outside [0, {self.n_layers}]")
        self._captured: torch.Tensor | None = None
        if self.n_layers in self.layer_ids:  # id L = the last layer's output BEFORE the final norm: hook it
            layers = self.model.model.layers
            layers[-1].register_forward_hook(self._capture)

    def _capture(self, module, args, output):
        self._captured = output[0] if isinstance(output, tuple) else output

    @torch.no_grad()
    def extract_batch(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several sequences in ONE right-padded forward (causal attention: padding never changes an earlier
        position) -> per sequence (aux [T_i, n·d], last [T_i, d]), bf16, on the model's device."""
        T = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), T), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s)
        out = self.model.model(input_ids=ids.to(self.device), output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # L+1 entries; [L] is after the final norm
        aux = torch.cat([(self._captured if k == self.n_layers else hs[k]) for k in self.layer_ids], dim=-1)
        aux, last = aux.to(torch.bfloat16), out.last_hidden_state.to(torch.bfloat16)
        return [(aux[j, :len(s)], last[j, :len(s)]) for j, s in enumerate(seqs)]

    def extract(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        aux, last = self.extract_batch([input_ids])[0]
        return aux.cpu(), last.cpu()
