"""A linear kernel for the few input rows of decoding and verification on AVX2 CPUs (fp32).

A decode step multiplies 1 row, a verification forward 1 + ℓ ≤ 8 rows, through every weight of the target: the time
is the weight bytes streamed from memory, so the kernel should cost about the same for 1 and for 8 rows.  On a
2-core AMD EPYC with AVX2 only, oneDNN's packed layout (pipeline/packed_linear.py) and MKL both fall short of that
(weights streamed from memory, 2 threads, ms per call):

    shape (SmolLM2)      rows   oneDNN packed   this kernel
    q/k/v  960x576        1        0.146          0.089
    down   576x1536       8        0.274          0.19-0.21
    gate/up 3072x576      8        0.474          0.382
    LM head 49152x576     1        4.32           3.90
    LM head 49152x576     8        7.24           6.19

`kernels/small_m_linear.cpp` keeps every weight row in registers while it multiplies it into all input rows
(tiles of input rows x weight rows, 8-wide FMA accumulators), the weight rows split over torch's intra-op threads.
It is built once per source version with torch's C++ extension loader (g++ and ninja, ~40 s; see `_load` for
why a build killed at any moment never blocks the next one) into
``<work>/cache/torch_extensions`` (``scripts/setup.sh`` builds it ahead) and used only where it is available: an
x86-64 CPU with AVX2 and FMA, fp32 weights whose input width is a multiple of 8.  Anything else -- no compiler, a
failed build, another CPU -- leaves the other back ends as they are (``available()`` is False, with the reason in
``unavailable_reason()``).  Same products, a different summation order: results agree with F.linear to fp32
rounding (tests/test_small_m_linear.py).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
from pathlib import Path

import torch

from pipeline.file_lock import LockTimeout, atomic_write_text, file_lock, sweep_temporaries, temporary_name
from pipeline.runtime import work_dir

SOURCE = Path(__file__).with_name("kernels") / "small_m_linear.cpp"
MAX_ROWS = 24  # the smallm back end runs inputs of at most this many rows through the kernel, larger ones packed

_module = None  # the loaded extension (None: not tried yet, or unavailable)
_reason: str | None = None  # why the kernel is unavailable (None: not tried yet, or available)


def cpu_supports() -> str | None:
    """None when this CPU can run the kernel (x86-64 with avx2 and fma), else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError as e:
        return f"cannot read /proc/cpuinfo ({e})"
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def build_dir() -> Path:
    return Path(os.environ.get("DSPARK_EXTENSIONS_DIR", work_dir() / "cache" / "torch_extensions"))


def lock_timeout_s() -> float:
    """How long a process waits for another one's build of the kernel (DSPARK_KERNEL_LOCK_TIMEOUT_S, default 600 s)."""
    return float(os.environ.get("DSPARK_KERNEL_LOCK_TIMEOUT_S", "600"))


CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
BUILT = "built.json"  # written last into a finished build: the library's name, size and sha1


def build_paths() -> tuple[str, Path]:
    """(module name, build folder) of this source version, torch version and flags."""
    digest = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()
    return f"dspark_small_m_linear_{digest[:12]}", build_dir() / f"small_m_linear_{digest[:12]}"


def _finished(folder: Path, name: str) -> Path | None:
    """The library of a finished build in ``folder`` (its ``built.json`` matches the file), else None."""
    try:
        meta = json.loads((folder / BUILT).read_text())
        lib = folder / meta["library"]
        data = lib.read_bytes()
    except (OSError, ValueError, KeyError):
        return None
    ok = meta.get("module") == name and len(data) == meta.get("bytes") and hashlib.sha1(data).hexdigest() == meta.get(
        "sha1")
    return lib if ok else None


def _import(name: str, lib: Path):
    spec = importlib.util.spec_from_file_location(name, lib)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(verbose: bool = False):
    """Import the finished build, or build it first.

    A finished build is imported without any lock.  A build runs under an OS lock (``pipeline.file_lock``: dropped
    by the kernel when its holder dies, waited for at most ``lock_timeout_s()``) in a fresh temporary folder, gets
    its ``built.json`` last and is renamed into place; so a build killed at any moment leaves no lock that
    blocks and no half-written folder that is taken for a finished one (it is rebuilt).  torch's own build lock
    (a plain file, ``lock``, left behind by a killed build) is only ever taken inside that temporary folder."""
    from torch.utils.cpp_extension import load

    name, folder = build_paths()
    lib = _finished(folder, name)
    if lib is not None:
        return _import(name, lib)
    with file_lock(folder.with_name(folder.name + ".lock"), timeout_s=lock_timeout_s(),
                   what="the small-M linear kernel build"):
        lib = _finished(folder, name)
        if lib is not None:  # another process built it while this one waited
            return _import(name, lib)
        sweep_temporaries(folder.parent, folder.name)
        tmp = temporary_name(folder)
        tmp.mkdir(parents=True)
        try:
            module = load(name=name, sources=[str(SOURCE)], build_directory=str(tmp), extra_cflags=CFLAGS,
                          extra_ldflags=["-fopenmp"], verbose=verbose)
            built = Path(module.__file__)
            data = built.read_bytes()
            atomic_write_text(tmp / BUILT, json.dumps({"module": name, "library": built.name, "bytes": len(data),
                                                       "sha1": hashlib.sha1(data).hexdigest()}))
            if folder.exists():  # an unfinished or damaged build (or one from before built.json): replaced
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return module


def ensure(verbose: bool = False) -> bool:
    """Build (first time) and load the kernel; True when it can be used.  Tried once per process."""
    global _module, _reason
    if _module is not None or _reason is not None:  # tried: loaded, or a reason why not
        return _module is not None
    if os.environ.get("DSPARK_NO_SMALL_M_KERNEL") == "1":
        _reason = "disabled by DSPARK_NO_SMALL_M_KERNEL=1"
        return False
    _reason = cpu_supports()
    if _reason is None:
        try:
            _module = _load(verbose)
        except LockTimeout as e:
            _reason = f"not loaded: {e}"
        except Exception as e:  # no compiler / ninja / headers, or a build lock not had in time: the others remain
            _reason = f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return _module is not None


def available() -> bool:
    return ensure()


def unavailable_reason() -> str | None:
    ensure()
    return _reason


def usable(weight: torch.Tensor) -> bool:
    """The kernel applies to this weight: contiguous fp32 [N, K] on the CPU with K a multiple of 8 (and the kernel
    loads)."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[1] % 8 == 0 and weight.is_contiguous() and available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N]; ``weight`` [N, K] contiguous fp32 (see :func:`usable`)."""
    if not ensure():
        raise RuntimeError(f"small_m_linear is unavailable: {_reason}")
    y = _module.small_m_linear(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


if __name__ == "__main__":  # scripts/setup.sh: build ahead of the first use
    ok = ensure(verbose=False)
    print(f"[setup] small-M linear kernel: {'built' if ok else 'not used (' + str(_reason) + ')'}")
