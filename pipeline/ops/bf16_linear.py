"""A batch-invariant linear for bf16 weights: fp32 activations, bf16 weights widened on the fly, fp32 accumulation
(``kernels/bf16_linear.cpp``, AVX-512).

Two things at once:

* speed: decoding and verification multiply a few rows through every weight, so they cost what streaming the
  weights costs, and bf16 weights are half the bytes of fp32 ones;
* batch invariance: each output element is reduced in one fixed order whatever the number of rows in the call, so
  row i of an M-row product is bit-identical to the 1-row product of the same input.  A verification forward of
  1 + ℓ rows per request, with any other requests beside it, then gives every row exactly what a 1-token decode
  step gives it: speculative greedy output equals plain greedy output token for token.

For a checkpoint stored in bf16 (SmolLM2 here) the weights are the checkpoint's exactly and the arithmetic is fp32,
so this is the fp32 model with half its weight bytes.  Built and loaded as pipeline/ops/extensions.py describes;
where the CPU lacks AVX-512 (``avx512f`` and ``avx512bw``) it is unavailable and says why.
"""
from __future__ import annotations

import torch

from pipeline.ops.extensions import CppExtension

EXT = CppExtension("bf16_linear", cpu_flags=("avx512f", "avx512bw"),
                   cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mfma", "-fopenmp"],
                   disable_env="DSPARK_NO_BF16_LINEAR_KERNEL", what="the bf16-weight linear kernel")
MULTIPLE = 16  # the input width must be a multiple of this


def available() -> bool:
    return EXT.available()


def unavailable_reason() -> str | None:
    return EXT.unavailable_reason()


def usable(weight: torch.Tensor) -> bool:
    """The kernel applies to this weight: contiguous bf16 [N, K] on the CPU with K a multiple of 16 (and it loads)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % MULTIPLE == 0 and weight.is_contiguous() and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] fp32; ``weight`` [N, K] contiguous bf16, ``bias`` [N] fp32 (see :func:`usable`)."""
    y = EXT.module.bf16_linear(x.reshape(-1, x.shape[-1]).float().contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


class InvariantLinear:
    """A frozen linear layer with bf16 weights run through the kernel for every row count (the target runner's
    ``bfloat16:invariant`` back end): fp32 in, fp32 out."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        if not usable(self.weight):
            raise ValueError(f"the bf16-weight kernel cannot take a {tuple(self.weight.shape)} weight "
                             f"({unavailable_reason() or f'its input width must be a multiple of {MULTIPLE}'})")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


if __name__ == "__main__":  # scripts/setup.sh: build ahead of the first use
    ok = EXT.ensure(verbose=False)
    print(f"[setup] bf16-weight linear kernel: {'built' if ok else 'not used (' + str(unavailable_reason()) + ')'}")
