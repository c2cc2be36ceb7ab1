"""A linear kernel for the few input rows of decoding and verification on AVX2 CPUs (fp32).

A decode step multiplies 1 row, a verification forward 1 + ℓ ≤ 8 rows, through every weight of the target: the time
is the weight bytes streamed from memory, so the kernel should cost about the same for 1 and for 8 rows.  On a CPU
with AVX2 only, oneDNN's packed layout (pipeline/ops/packed_linear.py) and MKL both fall short of that, at 1 row and
at 8, for every weight shape of the target (measurements: docs/results/speed_single_stream.md).

`kernels/small_m_linear.cpp` keeps every weight row in registers while it multiplies it into all input rows
(tiles of input rows x weight rows, 8-wide FMA accumulators), the weight rows split over torch's intra-op threads.
It is built and loaded as pipeline/ops/extensions.py describes (once per source version, by
``scripts/setup.sh`` ahead of its first use) and used only where it is available: an x86-64 CPU with AVX2 and FMA,
fp32 weights whose input width is a multiple of 8.  Anything else -- no compiler, a
failed build, another CPU -- leaves the other back ends as they are (``available()`` is False, with the reason in
``unavailable_reason()``).  Same products, a different summation order: results agree with F.linear to fp32
rounding (tests/test_small_m_linear.py).
"""
from __future__ import annotations

import torch

from pipeline.ops.extensions import CppExtension

MAX_ROWS = 24  # the smallm back end runs inputs of at most this many rows through the kernel, larger ones packed
EXT = CppExtension("small_m_linear", cpu_flags=("avx2", "fma"), cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                   disable_env="DSPARK_NO_SMALL_M_KERNEL", what="the small-M linear kernel")


def ensure(verbose: bool = False) -> bool:
    """Build (first time) and load the kernel; True when it can be used.  Tried once per process."""
    return EXT.ensure(verbose)


def available() -> bool:
    return EXT.available()


def unavailable_reason() -> str | None:
    return EXT.unavailable_reason()


def usable(weight: torch.Tensor) -> bool:
    """The kernel applies to this weight: contiguous fp32 [N, K] on the CPU with K a multiple of 8 (and the kernel
    loads)."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[1] % 8 == 0 and weight.is_contiguous() and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N]; ``weight`` [N, K] contiguous fp32 (see :func:`usable`)."""
    y = EXT.module.small_m_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


if __name__ == "__main__":  # scripts/setup.sh: build ahead of the first use
    ok = ensure(verbose=False)
    print(f"[setup] small-M linear kernel: {'built' if ok else 'not used (' + str(unavailable_reason()) + ')'}")
