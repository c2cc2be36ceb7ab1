"""Hidden-state extraction with transformers (the fallback extractor, and the reference the vLLM one is tested
against).  One forward over prompt + response; returns the chosen layers (vLLM id convention) and the final hidden
state after the final norm (the LM-head input), both bf16."""
from __future__ import annotations

from pathlib import Path

import torch


class HFExtractor:
    def __init__(self, target: str | Path, layer_ids: list[int], dtype: torch.dtype = torch.float32,
                 device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()
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
    def extract(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([input_ids], device=self.device)
        out = self.model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # L+1 entries; [L] is after the final norm
        parts = [(self._captured if k == self.n_layers else hs[k])[0] for k in self.layer_ids]
        aux = torch.cat(parts, dim=-1).to(torch.bfloat16).cpu()
        last = out.last_hidden_state[0].to(torch.bfloat16).cpu()
        return aux, last
