"""Build and load the native CPU kernels (C++ sources beside this file) at first use.

The CPU worker's memory-bound hot loops that torch serves poorly (decode attention over
the paged KV cache, small-batch linear layers) are small C++ files compiled here with
the system's C++ compiler, cached under <cache>/kernels/<key>/ and loaded with ctypes
(plain C ABI: no torch headers, so a build takes about a second). The key covers the
source and the shared headers, the flags, the compiler and the CPU's feature flags,
because `-march=native` code may not run on another CPU model.

OpenMP: the library links `libgomp.so.1`, which resolves to the copy torch has already
loaded, so the kernels share torch's thread pool and `torch.set_num_threads`.

Without a compiler (or with KVFLOW_CPU_KERNELS=0) `load_library` returns None and the
callers keep their torch paths; the reason is logged once.

Kernels called many times per step at tiny sizes (the elementwise ones) can also be
built as a CPython extension module (`load_module`): same C functions, called without
ctypes' per-argument conversion. It needs Python's headers; without them the ctypes
library serves.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch

from kvflow.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
# -fno-trapping-math lets the compiler vectorize branches (the exp clamp); nothing here
# relies on floating-point exceptions.
CXX_FLAGS = (
    "-O3",
    "-fopenmp",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo names; empty where unknown)."""
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") else set()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _flags(march: str) -> tuple[str, ...]:
    return (f"-march={march}", *CXX_FLAGS)


def _build_key(source: Path, compiler: str, march: str, extra: Sequence[str] = ()) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    digest = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))  # included by every source
    for part in (source, *headers):
        digest.update(part.read_bytes())
    for text in (" ".join((*_flags(march), *extra)), version):
        digest.update(text.encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _build(
    source: Path, compiler: str, target: Path, march: str, extra: Sequence[str] = ()
) -> None:
    """Compile to a temporary name, then rename: concurrent workers never load a torn file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *_flags(march), *extra, str(source), "-o", str(partial)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{result.stderr[-2000:]}")
        os.replace(partial, target)


@functools.cache
def load_library(name: str, march: str = "native") -> ctypes.CDLL | None:
    """The compiled `<name>.cpp` of this folder, built on first use; None if unavailable.
    `march` other than "native" builds for an older ISA (e.g. "x86-64": no AVX at all),
    which tests use to check a kernel's portable path on any x86 machine."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        logger.info("native CPU kernels off (KVFLOW_CPU_KERNELS=0): using the torch paths")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found: native CPU kernels off, using the torch paths")
        return None
    source = SOURCE_DIR / f"{name}.cpp"
    key = _build_key(source, compiler, march)
    target = default_cache_dir() / "kernels" / key / f"{name}.so"
    try:
        if not target.exists():
            logger.info("building native CPU kernel %s with %s", name, compiler)
            _build(source, compiler, target, march)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as error:
        logger.warning("native CPU kernel %s unavailable (%s): using the torch path", name, error)
        return None


@functools.cache
def load_module(name: str) -> ModuleType | None:
    """`<name>.cpp` built as the CPython extension module `kvflow_<name>` (the source's
    `#ifdef KVFLOW_PYTHON_MODULE` part: METH_FASTCALL wrappers of its kernels, named as
    the C functions), for kernels called so often that ctypes' argument conversion
    (~0.25 us per argument) matters. None where it cannot be built (no Python headers,
    no compiler, KVFLOW_CPU_KERNELS=0): the caller uses `load_bound`'s ctypes instead."""
    if os.environ.get("KVFLOW_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    include = sysconfig.get_paths().get("include")
    if compiler is None or not include or not (Path(include) / "Python.h").exists():
        logger.info("no Python headers: native kernel %s called through ctypes", name)
        return None
    source = SOURCE_DIR / f"{name}.cpp"
    extra = ("-DKVFLOW_PYTHON_MODULE", f"-I{include}")
    key = _build_key(source, compiler, "native", extra)
    target = default_cache_dir() / "kernels" / key / f"kvflow_{name}.so"
    try:
        if not target.exists():
            logger.info("building native CPU kernel module %s with %s", name, compiler)
            _build(source, compiler, target, "native", extra)
        spec = importlib.util.spec_from_file_location(f"kvflow_{name}", target)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("native CPU kernel module %s unavailable (%s): using ctypes", name, error)
        return None


# The `dtype` argument every kernel takes, and the ctypes of its other arguments.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
POINTER, INT64 = ctypes.c_void_p, ctypes.c_int64


def load_bound(
    name: str, signatures: Mapping[str, Sequence[type]], march: str = "native"
) -> ctypes.CDLL | None:
    """`load_library(name, march)` with the argument types of its functions set; every
    kernel returns an int status (0 = done)."""
    library = load_library(name, march)
    if library is not None:
        for function, argtypes in signatures.items():
            getattr(library, function).restype = ctypes.c_int
            getattr(library, function).argtypes = list(argtypes)
    return library


NATIVE_KERNELS = (
    "paged_decode_attention",
    "prefill_attention",
    "skinny_linear",
    "block_linear",
    "elementwise",
    "int8_linear",
    "bf16_gemm",
    "block_vnni",
    "fused_moe",
    "lora",
)


# Also built as CPython modules where Python's headers exist (optional: ctypes serves).
MODULE_KERNELS = ("elementwise",)


def load_all() -> list[str]:
    """Build (or find cached) every native kernel now rather than inside the first
    request's step; the names of those unavailable (already logged)."""
    for name in MODULE_KERNELS:
        load_module(name)
    return [name for name in NATIVE_KERNELS if load_library(name) is None]


def build_all() -> None:
    """`load_all`, raising if a kernel is unavailable. Image builds call this so a
    container starts with its kernels compiled."""
    missing = load_all()
    if missing:
        raise RuntimeError(f"native CPU kernels unavailable: {', '.join(missing)} (see log)")
