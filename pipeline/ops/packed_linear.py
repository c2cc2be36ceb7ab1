"""Linear layers with oneDNN pre-packed fp32 weights on CPU (inference only).

F.linear (MKL sgemm) is slow on some CPUs when the input has a few rows -- exactly the shapes of speculative
decoding (a verification forward of 1 + ℓ tokens per request, a drafter block of γ tokens): there a few-token
verification forward can cost far more than a 1-token decode step although both stream the weights from memory
once (measurements: docs/results/speed_single_stream.md).  With the weight re-laid out once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU freezing pass uses) the cost follows the bytes
moved.  Same values, a different summation order: results agree with F.linear to fp32 rounding (tests compare both
back ends with transformers).

* :class:`PackedWeight` -- a frozen weight (+ bias) packed once (the target runner).
* :func:`tune_flinear_rows` -- per weight shape, the row count up to which F.linear is faster, timed on this machine
  (the crossover differs by shape: the wide fused gate/up and LM head cross over at fewer rows than the narrower
  projections; ``python -m jobs.bench linear``, measurements: docs/results/speed_single_stream.md).
* :class:`Linear` -- a drop-in ``nn.Linear`` for modules that are also trained (the drafter): with autograd on it is
  ``nn.Linear``; under ``no_grad`` / ``inference_mode`` on CPU in fp32 (and in bf16 on a CPU with native bf16) it
  uses a packed copy, re-packed whenever the weight changes (its version counter moves on every optimizer step).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.ops import bf16_linear, small_m_linear
from pipeline.core.runtime import cpu_has_native_bf16

PACK_ROWS_HINT = 16  # the row count oneDNN tunes the packed layout for; any row count works


def available() -> bool:
    """oneDNN's packed fp32 linear is in this PyTorch build."""
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32 CPU weight -> oneDNN's packed layout (an opaque tensor for :func:`packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> [..., out] with a weight from :func:`pack`."""
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [None], "")
    return y.view(*lead, y.shape[-1])


class PackedWeight:
    """A frozen linear layer: packed for oneDNN when ``use_packed`` (fp32 on CPU), else kept for F.linear.

    ``flinear_max_rows`` > 0 (with ``use_packed``): keep the plain weight too and run inputs of at most that many rows
    through F.linear, larger ones packed -- on some CPUs MKL is faster for 1-2 rows and oneDNN's packed layout from
    4 rows on (measurements: docs/results/speed_single_stream.md); costs a second copy of the weight.
    ``kernel_max_rows`` > 0 (with ``use_packed``, where pipeline/ops/small_m_linear.py applies to the weight): inputs of
    at most that many rows go through that kernel instead (it reads the plain weight, also kept)."""

    __slots__ = ("weight", "bias", "packed", "flinear_max_rows", "kernel_max_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_packed: bool, flinear_max_rows: int = 0,
                 kernel_max_rows: int = 0):
        self.bias = bias
        weight = weight.contiguous()
        self.packed = pack(weight) if use_packed else None
        self.flinear_max_rows = int(flinear_max_rows) if use_packed else 0
        self.kernel_max_rows = int(kernel_max_rows) if use_packed and small_m_linear.usable(weight) else 0
        # without the hybrid rule or the kernel the packed copy replaces the weight (same values, oneDNN layout)
        keep = not use_packed or self.flinear_max_rows > 0 or self.kernel_max_rows > 0
        self.weight = weight if keep else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if rows <= self.kernel_max_rows:
            return small_m_linear.linear(x, self.weight, self.bias)
        if self.packed is not None and rows > self.flinear_max_rows:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def _interleaved_medians(first, second, reps: int) -> tuple[float, float]:
    """Median seconds of ``reps`` calls of each zero-argument callable, taking turns (first second, second first,
    ...) after one warm-up round, so a burst of contention hits both alike."""
    times = ([], [])
    for k in range(reps + 1):
        for i in ((0, 1) if k % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            (first, second)[i]()
            if k:
                times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


_FLINEAR_WINS_ONE_ROW: dict = {}  # hidden size -> whether F.linear beat the packed weight at 1 row (this process)


def flinear_wins_one_row(d: int, reps: int = 15) -> bool:
    """Whether F.linear (MKL) beats the oneDNN-packed layout for one input row through an fp32 [4d, d] weight on this
    CPU: measured once per process and hidden size (interleaved, medians; a few ms), so every runner of a process
    takes the same automatic back end.  The answer differs between CPUs: MKL can win at 1-2 rows on one and lose
    clearly to the packed layout on another (measurements: docs/results/speed_single_stream.md, load_test.md)."""
    if d not in _FLINEAR_WINS_ONE_ROW:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4 * d, d, generator=g)
        pw = PackedWeight(w, None, True, 0)
        x = torch.randn(1, d, generator=g)
        t_flinear, t_packed = _interleaved_medians(lambda: [F.linear(x, w) for _ in range(8)],
                                                   lambda: [packed_linear(x, pw.packed, None) for _ in range(8)], reps)
        _FLINEAR_WINS_ONE_ROW[d] = t_flinear < t_packed
    return _FLINEAR_WINS_ONE_ROW[d]


_KERNEL_WINS: dict = {}  # hidden size -> whether the small-M kernel beat the packed weight (this process)


def kernel_wins_few_rows(d: int = 576, rows=(1, 8), reps: int = 15) -> bool:
    """Whether pipeline/ops/small_m_linear.py's kernel beats the oneDNN-packed layout for an fp32 [4d, d] weight at every
    row count of ``rows`` on this CPU (False where the kernel is unavailable): measured once per process and hidden
    size, interleaved, medians.  Where it wins (e.g. AVX2 without AVX-512), the whole forward of 1 and of 8 tokens
    gets faster (measurements: docs/results/speed_single_stream.md)."""
    if d not in _KERNEL_WINS:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(4 * d, d, generator=g)
        if not small_m_linear.usable(w):
            _KERNEL_WINS[d] = False
            return False
        pw = PackedWeight(w, None, True, 0)
        wins = True
        for r in rows:
            x = torch.randn(r, d, generator=g)
            t_packed, t_kernel = _interleaved_medians(lambda: [packed_linear(x, pw.packed, None) for _ in range(8)],
                                                      lambda: [small_m_linear.linear(x, w) for _ in range(8)], reps)
            wins = wins and t_kernel < t_packed
        _KERNEL_WINS[d] = wins
    return _KERNEL_WINS[d]


def tune_flinear_rows(groups: dict[str, list[PackedWeight]], rows=(1, 2, 4, 8, 16), reps: int = 5) -> dict[str, int]:
    """Set ``flinear_max_rows`` of every weight in each group (weights of one shape, e.g. every layer's q/k/v) to the
    largest of ``rows`` up to which F.linear beat the packed weight at EVERY row count (0: packed from 1 row).

    Each timing is one pass over the whole group - every weight streamed from memory once, as in a forward - with
    the two back ends interleaved (A B, B A, ...), medians of ``reps`` passes after a warm-up pass.  Weights need
    both copies (built with ``flinear_max_rows`` > 0); a group tuned to 0 drops its plain copies.  Returns
    {group: rows}.  Only speed depends on it: both back ends compute the same product (fp32 rounding apart)."""
    chosen = {}
    g = torch.Generator().manual_seed(0)
    for name, ws in groups.items():
        ws = [w for w in ws if w.packed is not None and w.weight is not None]
        if not ws:
            continue
        best = 0
        for r in rows:
            x = torch.randn(r, ws[0].weight.shape[1], generator=g)
            t_flinear, t_packed = _interleaved_medians(lambda: [F.linear(x, w.weight, w.bias) for w in ws],
                                                       lambda: [packed_linear(x, w.packed, w.bias) for w in ws], reps)
            if t_flinear >= t_packed:
                break
            best = r
        for w in ws:
            w.flinear_max_rows = best
            if best == 0 and not w.kernel_max_rows:
                w.weight = None
        chosen[name] = best
    return chosen


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) that runs packed at inference on CPU in fp32, and in bf16 where
    the CPU multiplies bf16 natively (avx512_bf16 / AMX); fp32 inputs of at most ``small_m_linear.MAX_ROWS`` rows
    (a drafting block) go through pipeline/ops/small_m_linear.py's kernel where it beats the packed layout on this CPU
    (a drafting round then gets faster too).  On a CPU with native bf16 a drafting round runs fastest in bf16
    packed, ahead of bf16 through F.linear and of fp32 packed (measurements: docs/results/speed_single_stream.md).

    The packed copy is rebuilt when the weight's storage or version counter changes (load_state_dict, plain
    optimizers).  FUSED optimizers (``torch.optim.AdamW(fused=True)``, as training uses) update the weights in place
    WITHOUT bumping the version counter: call ``forget_packed(model)`` after such steps before inference."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed = None
        self._packed_key = None
        self.bf16_kernel = False  # use_bf16_kernel: fp32 inference through pipeline/ops/bf16_linear.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (torch.is_grad_enabled() or w.device.type != "cpu" or w.dtype not in _PACKED_DTYPES or x.dtype != w.dtype
                or not _AVAILABLE):
            return F.linear(x, w, self.bias)
        if self.bf16_kernel and w.dtype == torch.float32:
            key = (w.data_ptr(), w._version)
            if self._packed_key != key:  # the bf16 copy stands in for the packed one
                self._packed, self._packed_key = bf16_linear.InvariantLinear(w.detach(), self.bias), key
            return self._packed(x)
        if (x.numel() <= small_m_linear.MAX_ROWS * x.shape[-1] and w.dtype == torch.float32
                and small_m_linear.usable(w) and kernel_wins_few_rows()):
            return small_m_linear.linear(x, w, self.bias)  # reads the weight itself: nothing to re-pack
        key = (w.data_ptr(), w._version)
        if self._packed_key != key:
            self._packed, self._packed_key = pack(w), key
        return packed_linear(x, self._packed, self.bias)


def use_bf16_kernel(module: nn.Module) -> int:
    """Run every fp32 :class:`Linear` under ``module`` whose shape the kernel takes through pipeline/ops/bf16_linear.py
    at inference (a bf16 copy of the weight beside the fp32 one; training is unchanged).  On a CPU with native bf16
    dot products a drafting round's linears then cost about half their fp32 time while norms, attention, the
    residual stream and the logits stay fp32 (measurements: docs/results/load_test.md).  Returns how many layers
    switched (0 where the kernel is unavailable)."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear) and not m.bf16_kernel and m.in_features % bf16_linear.MULTIPLE == 0 \
                and bf16_linear.available():
            m.bf16_kernel, m._packed, m._packed_key = True, None, None
            n += 1
    return n


def forget_packed(module: nn.Module) -> int:
    """Drop every cached packed weight under ``module`` (the next no-grad forward packs the current weights).
    Needed after updates the version counter does not see (fused optimizers).  Returns how many were dropped."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear) and m._packed is not None:
            m._packed, m._packed_key = None, None
            n += 1
    return n


_AVAILABLE = available()
# bf16 is packed only where oneDNN has native bf16 kernels: emulated bf16 is slower than fp32 on an AVX2 CPU
_PACKED_DTYPES = (torch.float32, torch.bfloat16) if cpu_has_native_bf16() else (torch.float32,)
