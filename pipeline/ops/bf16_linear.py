"""A batch-invariant linear for bf16 weights, fp32 accumulation, two kernels:

* ``kernels/bf16_dot_linear.cpp`` (CPUs with AVX512_BF16): the input rows rounded to bf16, the CPU's native bf16
  dot products (vdpbf16ps), for every weight whose input width is a multiple of 32;
* ``kernels/bf16_linear.cpp`` (AVX-512): fp32 activations, bf16 weights widened on the fly, fp32 arithmetic, for
  the other weights and on AVX-512 CPUs without native bf16 (or with ``DSPARK_NO_BF16_DOT_KERNEL=1``).

A weight always goes through the same kernel, whatever the number of rows (``arithmetic``).

Two things at once:

* speed: decoding and verification multiply a few rows through every weight, so they cost what streaming the
  weights costs, and bf16 weights are half the bytes of fp32 ones;
* batch invariance: each output element is reduced in one fixed order whatever the number of rows in the call, so
  row i of an M-row product is bit-identical to the 1-row product of the same input.  A verification forward of
  1 + ℓ rows per request, with any other requests beside it, then gives every row exactly what a 1-token decode
  step gives it: speculative greedy output equals plain greedy output token for token.

The native dot products do 32 multiply-adds per instruction against 16 and need no widening: about 2x on a layer's
linears once 8 or more rows share the weights (verification of many requests, prefill), where the product is bound
by arithmetic rather than by streaming the weights (measurements: docs/results/load_test.md).  Their inputs are
bf16, as in any bf16 inference (vLLM-CPU's included); the fp32-activation kernel is the fp32 model with half its
weight bytes.  Built and loaded as pipeline/ops/extensions.py describes; where the CPU lacks AVX-512 (``avx512f``
and ``avx512bw``) both are unavailable and say why.
"""
from __future__ import annotations

import torch

from pipeline.ops.extensions import CppExtension

EXT = CppExtension("bf16_linear", cpu_flags=("avx512f", "avx512bw"),
                   cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mfma", "-fopenmp"],
                   disable_env="DSPARK_NO_BF16_LINEAR_KERNEL", what="the bf16-weight linear kernel")
DOT = CppExtension("bf16_dot_linear", cpu_flags=("avx512f", "avx512bw", "avx512_bf16"),
                   cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"],
                   disable_env="DSPARK_NO_BF16_DOT_KERNEL", what="the native bf16 dot-product linear kernel")
MULTIPLE = 16  # the input width must be a multiple of this
DOT_MULTIPLE = 32  # ... and of this for the native bf16 dot products


def available() -> bool:
    return EXT.available()


def unavailable_reason() -> str | None:
    return EXT.unavailable_reason()


def usable(weight: torch.Tensor) -> bool:
    """The kernel applies to this weight: contiguous bf16 [N, K] on the CPU with K a multiple of 16 (and it loads)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % MULTIPLE == 0 and weight.is_contiguous() and available())


def arithmetic(in_features: int) -> str:
    """How a weight of this input width is multiplied, for every row count: ``"bf16"`` (inputs rounded to bf16,
    native dot products) or ``"fp32"`` (fp32 inputs, widened weights)."""
    return "bf16" if in_features % DOT_MULTIPLE == 0 and DOT.available() else "fp32"


def version() -> str:
    """Which kernel sources this machine multiplies with (a cost profile taken with others does not apply)."""
    return " ".join(ext.build_paths()[0] for ext in (EXT, DOT) if ext.available())


def kernel(in_features: int):
    """The kernel function ``(x [M, K] fp32, w [N, K] bf16, b [N] fp32 | None) -> [M, N] fp32`` of this width."""
    return DOT.module.bf16_dot_linear if arithmetic(in_features) == "bf16" else EXT.module.bf16_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fn=None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] fp32; ``weight`` [N, K] contiguous bf16, ``bias`` [N] fp32 (see :func:`usable`);
    ``fn``: the kernel function when already chosen (``kernel``)."""
    y = (fn or kernel(weight.shape[1]))(x.reshape(-1, x.shape[-1]).float().contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


class InvariantLinear:
    """A frozen linear layer with bf16 weights run through the kernel for every row count (the target runner's
    ``bfloat16:invariant`` back end): fp32 in, fp32 out."""

    __slots__ = ("weight", "bias", "fn")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        if not usable(self.weight):
            raise ValueError(f"the bf16-weight kernel cannot take a {tuple(self.weight.shape)} weight "
                             f"({unavailable_reason() or f'its input width must be a multiple of {MULTIPLE}'})")
        self.fn = kernel(self.weight.shape[1])  # chosen once: every row count goes through the same kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fn)


if __name__ == "__main__":  # scripts/setup.sh: build ahead of the first use
    ok = EXT.ensure(verbose=False)
    print(f"[setup] bf16-weight linear kernel: {'built' if ok else 'not used (' + str(unavailable_reason()) + ')'}")
    ok = DOT.ensure(verbose=False)
    print(f"[setup] native bf16 dot-product linear kernel: "
          f"{'built' if ok else 'not used (' + str(DOT.unavailable_reason()) + ')'}")
