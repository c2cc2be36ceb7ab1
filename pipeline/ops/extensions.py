"""The project's C++ CPU kernels (``pipeline/ops/kernels/*.cpp``): built once per source version, loaded without a
lock, and never a reason for a start to hang.

    EXT = CppExtension("small_m_linear", cpu_flags=("avx2", "fma"), cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                       disable_env="DSPARK_NO_SMALL_M_KERNEL")
    if EXT.available():
        EXT.module.small_m_linear(x, w, None)
    else:
        print(EXT.unavailable_reason())         # no compiler, another CPU, a build lock not had in time, ...

A kernel is built with torch's C++ extension loader (g++ and ninja) into ``<work>/cache/torch_extensions/
<name>_<digest>/`` (``DSPARK_EXTENSIONS_DIR`` overrides the parent), the digest covering the source, the torch
version and the flags; ``scripts/setup.sh`` builds every kernel ahead of its first use.  A finished build (its
``built.json``, written last, matches the library's size and sha1) is imported without any lock.  A build runs
under an OS lock (pipeline/core/file_lock.py: dropped by the kernel when its holder dies, waited for at most
``DSPARK_KERNEL_LOCK_TIMEOUT_S``, 600 s) in a fresh temporary folder that is renamed into place, so a build killed
at any moment leaves no lock that blocks and no half-written folder that is taken for a finished one (it is
rebuilt); torch's own build lock (a plain file, ``lock``) is only ever taken inside that temporary folder.  Where a
kernel cannot be had the callers keep their other back ends (``available()`` is False, the reason in
``unavailable_reason()``).
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

from pipeline.core.file_lock import LockTimeout, atomic_write_text, file_lock, sweep_temporaries, temporary_name
from pipeline.core.runtime import work_dir

KERNELS = Path(__file__).with_name("kernels")
BUILT = "built.json"  # written last into a finished build: the library's name, size and sha1


def build_dir() -> Path:
    return Path(os.environ.get("DSPARK_EXTENSIONS_DIR", work_dir() / "cache" / "torch_extensions"))


def lock_timeout_s() -> float:
    """How long a process waits for another one's build of a kernel (DSPARK_KERNEL_LOCK_TIMEOUT_S, default 600 s)."""
    return float(os.environ.get("DSPARK_KERNEL_LOCK_TIMEOUT_S", "600"))


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (None where /proc/cpuinfo cannot be read)."""
    try:
        return set(next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                         if ln.startswith("flags")), []))
    except OSError:
        return None


class CppExtension:
    """One kernel source ``kernels/<name>.cpp``, loaded once per process (see the module docstring)."""

    def __init__(self, name: str, cpu_flags: tuple[str, ...], cflags: list[str], disable_env: str | None = None,
                 what: str | None = None):
        self.name, self.required, self.cflags, self.disable_env = name, tuple(cpu_flags), list(cflags), disable_env
        self.what = what or f"the {name} kernel"
        self.source = KERNELS / f"{name}.cpp"
        self._module = None
        self._reason: str | None = None  # why it is unavailable (None: not tried yet, or loaded)

    # ------------------------------------------------------------------ where
    def build_paths(self) -> tuple[str, Path]:
        """(module name, build folder) of this source version, torch version and flags."""
        digest = hashlib.sha1(self.source.read_bytes() + torch.__version__.encode() +
                              " ".join(self.cflags).encode()).hexdigest()[:12]
        return f"dspark_{self.name}_{digest}", build_dir() / f"{self.name}_{digest}"

    @staticmethod
    def finished(folder: Path, name: str) -> Path | None:
        """The library of a finished build in ``folder`` (its ``built.json`` matches the file), else None."""
        try:
            meta = json.loads((folder / BUILT).read_text())
            lib = folder / meta["library"]
            data = lib.read_bytes()
        except (OSError, ValueError, KeyError):
            return None
        ok = (meta.get("module") == name and len(data) == meta.get("bytes")
              and hashlib.sha1(data).hexdigest() == meta.get("sha1"))
        return lib if ok else None

    # ------------------------------------------------------------------ load
    def cpu_supports(self) -> str | None:
        """None when this CPU can run the kernel (x86-64 with the required flags), else why not."""
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return f"not an x86-64 CPU ({platform.machine()})"
        flags = cpu_flags()
        if flags is None:
            return "cannot read /proc/cpuinfo"
        missing = [f for f in self.required if f not in flags]
        return f"the CPU lacks {', '.join(missing)}" if missing else None

    def _import(self, name: str, lib: Path):
        spec = importlib.util.spec_from_file_location(name, lib)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _load(self, verbose: bool = False):
        from torch.utils.cpp_extension import load

        name, folder = self.build_paths()
        lib = self.finished(folder, name)
        if lib is not None:
            return self._import(name, lib)
        with file_lock(folder.with_name(folder.name + ".lock"), timeout_s=lock_timeout_s(),
                       what=f"the build of {self.what}"):
            lib = self.finished(folder, name)
            if lib is not None:  # another process built it while this one waited
                return self._import(name, lib)
            sweep_temporaries(folder.parent, folder.name)
            tmp = temporary_name(folder)
            tmp.mkdir(parents=True)
            try:
                module = load(name=name, sources=[str(self.source)], build_directory=str(tmp),
                              extra_cflags=self.cflags, extra_ldflags=["-fopenmp"], verbose=verbose)
                built = Path(module.__file__)
                data = built.read_bytes()
                atomic_write_text(tmp / BUILT, json.dumps({"module": name, "library": built.name,
                                                           "bytes": len(data), "sha1": hashlib.sha1(data).hexdigest()}))
                if folder.exists():  # an unfinished or damaged build (or one from before built.json): replaced
                    shutil.rmtree(folder)
                os.replace(tmp, folder)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        return module

    def ensure(self, verbose: bool = False) -> bool:
        """Build (first time) and load the kernel; True when it can be used.  Tried once per process."""
        if self._module is not None or self._reason is not None:
            return self._module is not None
        if self.disable_env and os.environ.get(self.disable_env) == "1":
            self._reason = f"disabled by {self.disable_env}=1"
            return False
        self._reason = self.cpu_supports()
        if self._reason is None:
            try:
                self._module = self._load(verbose)
            except LockTimeout as e:
                self._reason = f"not loaded: {e}"
            except Exception as e:  # no compiler / ninja / headers: the other back ends remain
                last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                self._reason = f"build failed: {type(e).__name__}: {last}"
        return self._module is not None

    def available(self) -> bool:
        return self.ensure()

    def unavailable_reason(self) -> str | None:
        self.ensure()
        return self._reason

    @property
    def module(self):
        if not self.ensure():
            raise RuntimeError(f"{self.what} is unavailable: {self._reason}")
        return self._module
