"""Build and load the CPU kernels (`paged_attention.cpp`, `elementwise.cpp`, `small_gemm.cpp`,
`small_gemm_bf16.cpp`) with the machine's C++ compiler, into one shared library.

The shared library is compiled once and cached under `<cache root>/kernels/cpu-<key>/`, where the
key hashes everything that changes the generated code: the sources, the compiler flags and
version, torch's version and C++ ABI, and the CPU model (the build targets `-march=native`).
A fresh machine builds at first use (or at `make` set-up, `python -m fleetserve.kernels.cpu`);
later processes only load. Concurrent first users (test workers, pods on one node) serialise on
a file lock, and the library is written under a temporary name and renamed into place, so a
reader never sees a half-written file.

`load_cpu_kernels()` never raises for a build problem: it returns a `CpuKernels` whose `error`
says why the kernels are unavailable, so the attention selector can fall back to the torch
reference with that reason in the log.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from fleetserve.envs import read_env

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("paged_attention.cpp", "elementwise.cpp", "small_gemm.cpp", "small_gemm_bf16.cpp")
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("fast_exp.h", "bf16.h"))
"""Included by the sources: part of the build key, not compiled on their own."""
OPS_NAMESPACE = "fleetserve_cpu"
_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=c++17",
    "-fPIC",
    "-shared",
    # Lets GCC turn a float comparison into a select (an exception flag is all it could change),
    # so that loops with a clamp vectorize: without it the plain loops of fast_exp.h's
    # exp_clamped (SiLU, and the softmax of AVX2 builds) stayed scalar. No value changes.
    "-fno-trapping-math",
)
_BUILD_TIMEOUT_S = 600


@dataclass(frozen=True)
class CpuKernels:
    """The outcome of loading: `error` is None when the `torch.ops.fleetserve_cpu` ops exist."""

    library: Path | None
    error: str | None
    built: bool = False
    """True when this call compiled the library (False: loaded from the cache)."""

    @property
    def available(self) -> bool:
        return self.error is None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key(compiler: str) -> str:
    """Hash of what the compiled code depends on (a change means a rebuild, never a stale hit)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    parts = [
        *(source.read_bytes().decode() for source in (*SOURCES, *HEADERS)),
        " ".join(_FLAGS),
        version,
        torch.__version__,
        str(torch._C._GLIBCXX_USE_CXX11_ABI),
        platform.machine(),
        _cpu_model(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [
        compiler,
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        *(str(source) for source in SOURCES),
        "-o",
        str(target),
        *[f"-L{d}" for d in lib_dirs],
        *[f"-Wl,-rpath,{d}" for d in lib_dirs],
        "-lc10",
        "-ltorch_cpu",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr[-2000:]}")


def ensure_built(cache_root: Path) -> tuple[Path, bool]:
    """The cached library's path, compiling it first when absent; (path, whether built now).

    Raises:
        RuntimeError: no compiler, or the compile failed (the message carries its stderr).
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    folder = cache_root / "kernels" / f"cpu-{build_key(compiler)}"
    library = folder / "fleetserve_cpu.so"
    if library.exists():
        return library, False
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # another process built it while we waited
            return library, False
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(fd)
        try:
            _compile(compiler, Path(tmp))
            os.replace(tmp, library)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return library, True


@cache
def load_cpu_kernels() -> CpuKernels:
    """Build (when needed) and load the CPU kernels once per process; never raises for a
    build or load failure (see `CpuKernels.error`)."""
    try:
        library, built = ensure_built(read_env().cache_root)
        torch.ops.load_library(str(library))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return CpuKernels(None, f"the CPU kernels could not be built or loaded: {exc}")
    return CpuKernels(library, None, built)
