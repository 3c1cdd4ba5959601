"""Small C kernels for the CPU hot paths, built when kvserve is installed, loaded through ctypes.

The C sources are in ``csrc/cpu`` (``cpu_ops.c``, ``gemv.c`` and the AMX header they share);
``setup.py`` compiles them at install time (``pip install .`` or ``pip install -e .``) into
plain shared libraries in ``kvserve/_C``, one per instruction-set variant:

===========================  ==================================================  ===========================
library                      picked when ``/proc/cpuinfo`` has                   used by
===========================  ==================================================  ===========================
``cpu_ops_avx512bf16.so``    :data:`AVX512` and ``avx512_bf16``                  :mod:`kvserve.kernels.cpu_ops`
``cpu_ops_avx512.so``        :data:`AVX512` (bf16 rounding in software)          :mod:`kvserve.kernels.cpu_ops`
``gemv.so``                  :data:`AVX512` (functions picked at run time)       :mod:`kvserve.worker.layers.linear`
``qgemv.so``                 :data:`AVX512` and ``avx512_vnni``                  :mod:`kvserve.worker.layers.quant`
===========================  ==================================================  ===========================

AMX (Sapphire Rapids and later) is no separate library: its functions carry their own
``target("amx-tile,amx-bf16")`` attributes and are switched on at run time only where the CPU
flags and Linux allow it (:func:`kvserve.kernels.cpu_ops.set_amx`). The portable fallback is
the PyTorch path every caller keeps: on a CPU without AVX-512, off x86-64, on CUDA tensors, with
``KVSERVE_DISABLE_CPU_KERNELS=1``, or when the install built no libraries (no compiler then;
``kvserve.kernels`` logs one warning line, once per process).

Nothing here runs a compiler: :func:`load_library` only opens a file that the install put
there, so kvserve gets its kernels on a machine without gcc. ``KVSERVE_KERNELS_DIR`` points
the loader at another directory of built libraries. Libraries are loaded after torch, so their
``libgomp.so.1`` resolves to the OpenMP runtime torch already uses (one thread pool, no
oversubscription).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

#: CPU features every kernel library needs (``/proc/cpuinfo`` names).
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"})


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (``/proc/cpuinfo``; empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def kernels_disabled() -> bool:
    """True when ``KVSERVE_DISABLE_CPU_KERNELS`` is set to anything but ``""``/``"0"``."""
    return os.environ.get("KVSERVE_DISABLE_CPU_KERNELS", "") not in ("", "0")


#: The variants of each kernel library, best first, with the CPU flags each needs.
VARIANTS: dict[str, tuple[tuple[str, frozenset[str]], ...]] = {
    "cpu_ops": (("cpu_ops_avx512bf16", AVX512 | {"avx512_bf16"}), ("cpu_ops_avx512", AVX512)),
    "gemv": (("gemv", AVX512),),
    "qgemv": (("qgemv", AVX512 | {"avx512_vnni"}),),
}


def lib_dir() -> Path:
    """Where the built libraries are: ``$KVSERVE_KERNELS_DIR``, else ``kvserve/_C`` beside this
    package (the source tree in an editable install, site-packages otherwise)."""
    env = os.environ.get("KVSERVE_KERNELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "_C"


def library_path(variant: str) -> Path:
    """The file of one built variant (``<lib_dir>/<variant>.so``; it may not exist)."""
    return lib_dir() / f"{variant}.so"


def pick_variant(name: str, flags: Optional[frozenset[str]] = None) -> Optional[str]:
    """The best variant of library ``name`` (a key of :data:`VARIANTS`) that this CPU runs and
    the install built; None if there is none.

    Args:
        name: ``"cpu_ops"`` or ``"gemv"``.
        flags: CPU flags to decide for (default: :func:`cpu_flags`).

    Raises:
        KeyError: for an unknown ``name``.
    """
    flags = cpu_flags() if flags is None else flags
    for variant, needs in VARIANTS[name]:
        if needs <= flags and library_path(variant).is_file():
            return variant
    return None


_missing_logged = False


def _log_missing() -> None:
    """The one log line (per process) saying that the install left no kernels to load."""
    global _missing_logged
    if _missing_logged:
        return
    _missing_logged = True
    flags = cpu_flags()  # (a library this CPU could not run anyway is not "missing")
    missing = [n for n in VARIANTS if pick_variant(n) is None and any(needs <= flags for _, needs in VARIANTS[n])]
    logger.warning("kvserve: no CPU kernel library for %s in %s (not built at install, see setup.py); "
                   "running on PyTorch ops", " or ".join(missing), lib_dir())


def load_library(name: str, variant: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """Load the built kernel library ``name`` for this CPU; None where that is impossible.
    Never compiles anything.

    Args:
        name: ``"cpu_ops"`` or ``"gemv"`` (a key of :data:`VARIANTS`).
        variant: load this variant instead of the one :func:`pick_variant` chooses (the caller
            must know that the CPU runs it; tests compare variants this way).

    Returns:
        The loaded library, or None on a non-x86-64 machine, a CPU without :data:`AVX512`, when
        kernels are disabled by the environment, or when no library was built (then one
        warning is logged, once per process) or it cannot be loaded (a warning says why).

    Raises:
        KeyError: for an unknown ``name``.
    """
    if name not in VARIANTS:
        raise KeyError(f"no kernel library {name!r}; there are {sorted(VARIANTS)}")
    if kernels_disabled() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if not AVX512 <= cpu_flags():
        return None
    if variant is None:
        variant = pick_variant(name)
        if variant is None:
            _log_missing()
            return None
    return _open(str(library_path(variant)))


@functools.lru_cache(maxsize=None)
def _open(path: str) -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        logger.warning("kvserve: cannot load CPU kernel library %s (%s); running on PyTorch ops", path, e)
        return None
