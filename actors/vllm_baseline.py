"""vLLM's own plain decoding (no speculation) of the target, as a no-speculation system of an evaluation.

A user who wants speed has vLLM's plain decoding to run instead of ours, so the evaluation measures it next to our
engine, on the same prompts with the same token budget, interleaved prompt by prompt, and every speed ratio is
taken against the fastest no-speculation system of the run (``pipeline.eval.evaluation``).

``VLLMPlainDecoding(target, dtype).generate([prompt_ids], params, max_tokens)`` has the calling convention of
``SpeculativeEngine.generate`` for one prompt and returns objects with ``output_ids`` and ``stats`` (a zero-round
``RequestStats``: vLLM decodes one token per forward).  The engine runs in this process
(``actors.vllm_engine.build_llm``), with vLLM's default stop on the target's end-of-sequence token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.vllm_engine import build_llm
from pipeline.engine.engine import RequestStats
from pipeline.ops.sampling import SamplingParams


@dataclass
class PlainOutput:
    output_ids: list
    finish_reason: str | None
    stats: RequestStats = field(default_factory=RequestStats)


class VLLMPlainDecoding:
    def __init__(self, target: str, dtype: str, max_model_len: int, seed: int = 0):
        self.dtype = dtype
        self.max_model_len = int(max_model_len)
        self.llm = build_llm(str(target), max_model_len=self.max_model_len, seed=seed, dtype=dtype)
        self.generate([[1, 2, 3, 4]], SamplingParams(), max_tokens=4)  # warm-up outside the timed prompts

    def generate(self, prompts: list[list[int]], params: SamplingParams, max_tokens: int) -> list[PlainOutput]:
        from vllm import SamplingParams as VSamplingParams

        for p in prompts:
            if len(p) + max_tokens > self.max_model_len:
                raise ValueError(f"vLLM baseline: a {len(p)}-token prompt + {max_tokens} new tokens exceeds its "
                                 f"max_model_len {self.max_model_len}")
        sp = VSamplingParams(temperature=params.temperature, top_p=params.top_p,
                             top_k=params.top_k if params.top_k > 0 else -1, seed=params.seed,
                             max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        return [PlainOutput(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
