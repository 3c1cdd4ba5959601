"""Small C kernels for the CPU hot paths, compiled on first use and called through ctypes.

Two libraries are built from C sources kept next to the code that calls them:

* :mod:`kvserve.worker.layers.linear`: gemv kernels for decode-sized matmuls;
* :mod:`kvserve.kernels.cpu_ops`: fused RMSNorm (+ residual add), SiLU-and-mul, RoPE, the
  KV-cache write (``reshape_and_cache``) and paged decode attention.

This module holds what they share: the CPU feature check and :func:`load_library`, which
compiles a source once per machine into ``$KVSERVE_CACHE_DIR/kernels`` (default
``~/.cache/kvserve/kernels``), keyed by a hash of the source, flags and compiler, and loads it.
Libraries are loaded after torch, so their ``libgomp.so.1`` resolves to the OpenMP runtime
torch already uses (one thread pool, no oversubscription).

Nothing here is required: where a kernel cannot be built or run (no C compiler, a CPU without
AVX-512, CUDA tensors, ``KVSERVE_DISABLE_CPU_KERNELS=1``) callers fall back to PyTorch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

#: C shared by the libraries that use Intel AMX tiles (needs <immintrin.h>, <stdint.h> and
#: <string.h> included first): the tile state request and the one tile configuration they use.
AMX_C_SOURCE = r"""
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kv_tilecfg_t;

/* Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 * 1 if granted. Per process; asking again is harmless. */
static int kv_amx_request(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Load this thread's tile configuration: all 8 tiles 16 rows x 64 bytes (release with
 * _tile_release() when done). */
static inline __attribute__((target("amx-tile"))) void kv_amx_config(void) {
    kv_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
"""

#: Compiler flags of every kernel library.
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
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


def cache_dir() -> Path:
    """Where compiled libraries are kept."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvserve")
    return Path(root) / "kernels"


def _build(name: str, source: str, cc: str) -> Path:
    """Compile ``source`` into the cache (atomic rename, safe with parallel processes)."""
    tag = hashlib.sha256((source + " ".join(CFLAGS) + cc).encode()).hexdigest()[:16]
    out = cache_dir() / f"kvserve_{name}_{tag}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        tmp_so = Path(tmp) / f"{name}.so"
        subprocess.run([cc, *CFLAGS, str(src), "-o", str(tmp_so), "-lm"], check=True, capture_output=True,
                       timeout=180)
        fd, staged = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        shutil.copyfile(tmp_so, staged)
        os.replace(staged, out)
    return out


def load_library(name: str, source: str) -> Optional[ctypes.CDLL]:
    """Build (once per machine) and load a kernel library; None where that is impossible.

    Args:
        name: short library name, part of the cached file name.
        source: the C source.

    Returns:
        The loaded library, or None on a non-x86-64 machine, a CPU without :data:`AVX512`, no C
        compiler (``$CC``, ``gcc`` or ``cc``), a failed build (a ``RuntimeWarning`` says why) or
        when kernels are disabled by the environment.
    """
    if kernels_disabled() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if not AVX512 <= cpu_flags():
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None
    try:
        return ctypes.CDLL(str(_build(name, source, cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"kvserve: CPU kernels {name!r} unavailable, using PyTorch ops ({e}; {detail[-500:]!r})",
                      RuntimeWarning, stacklevel=2)
        return None
