"""Build kvserve's CPU kernels (``csrc/cpu``) at install time; the metadata is in pyproject.toml.

The kernels are plain C shared libraries, not Python extension modules: ``kvserve.kernels``
loads them with ctypes (no PyInit, no Python or torch headers, so the build needs neither
torch nor Python.h, only a C compiler with OpenMP). One library per instruction-set variant:

* ``kvserve/_C/cpu_ops_avx512.so``: the fused ops for AVX-512 CPUs (float32 -> bf16 rounding in
  software);
* ``kvserve/_C/cpu_ops_avx512bf16.so``: the same source built with ``KV_AVX512BF16`` (rounding by
  VCVTNEPS2BF16, and the AVX512-BF16 prefill attention kernel for CPUs without AMX), for CPUs
  with AVX512_BF16;
* ``kvserve/_C/gemv.so``: the linear kernels; each function carries its own target attribute,
  so one build serves every AVX-512 CPU and the caller picks the functions at run time.
* ``kvserve/_C/qgemv.so``: the linear kernel on GGUF-quantized weights (AVX512-VNNI), same way.

AMX is no variant of its own: its functions are compiled in both cpu_ops variants and gemv
under ``__attribute__((target("...amx-tile,amx-bf16")))`` and only called after a run-time
check of the CPU flags and Linux's grant of the tile state (``set_amx`` / ``kv_amx_init``),
so an AMX build would be the same bytes as the avx512bf16 one.

The portable fallback is kvserve's PyTorch path (every kernel has one). A failed build (no
compiler, another architecture, an old gcc) does not fail the install: the build prints one
warning and kvserve logs one line at run time and runs on PyTorch ops.
"""

from __future__ import annotations

import os
import shlex
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: Compiler flags of every kernel library: what kvserve used when it compiled them at run time
#: (Python's own CFLAGS, e.g. -g -fwrapv, and $CFLAGS are not used; $CC picks the compiler).
CFLAGS = ["-O3", "-fopenmp", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]


def _kernel(name: str, source: str) -> Extension:
    depends = ["csrc/cpu/amx.h", "csrc/cpu/bf16.h"] + (["csrc/cpu/cpu_ops.c"] if name.startswith("cpu_ops") else [])
    return Extension(f"kvserve._C.{name}", sources=[source], depends=depends, libraries=["m"], optional=True)


class BuildKernels(build_ext):
    """build_ext for plain C libraries: today's compiler flags, ``<name>.so`` (no ABI tag, as
    these are not Python modules), built in parallel, and a failure is a warning, not an error."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        self.failed: list[str] = []

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extensions(self) -> None:
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        self.compiler.set_executables(compiler_so=[*cc, *CFLAGS], linker_so=[*cc, *LDFLAGS])
        super().build_extensions()
        if self.failed:
            print(f"WARNING: kvserve: CPU kernels not built ({'; '.join(self.failed)}); "
                  "kvserve will run on PyTorch ops")

    def copy_extensions_to_source(self) -> None:
        # editable install: the libraries go to src/kvserve/_C, which is not in git
        os.makedirs(os.path.join("src", "kvserve", "_C"), exist_ok=True)
        super().copy_extensions_to_source()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # any compiler or linker failure: the install goes on without it
            self.failed.append(f"{ext.name}: {type(e).__name__}: {str(e).strip()[-300:]}")


setup(
    ext_modules=[
        _kernel("cpu_ops_avx512", "csrc/cpu/cpu_ops.c"),
        _kernel("cpu_ops_avx512bf16", "csrc/cpu/cpu_ops_avx512bf16.c"),
        _kernel("gemv", "csrc/cpu/gemv.c"),
        _kernel("qgemv", "csrc/cpu/qgemv.c"),
    ],
    cmdclass={"build_ext": BuildKernels},
)
