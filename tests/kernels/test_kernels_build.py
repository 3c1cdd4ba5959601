"""The kernel libraries built at install (setup.py, csrc/cpu) and their loader, kvserve.kernels:
the right variant is loaded without a compiler, a missing build falls back with one log line,
and the torch.library ops pass opcheck."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvserve.kernels as kernels
from kvserve.kernels import cpu_ops as K
from kvserve.worker.layers import linear

HAS_AVX512 = kernels.AVX512 <= kernels.cpu_flags()
needs_kernels = pytest.mark.skipif(not K.available(), reason="needs the built kernels and an AVX-512 CPU")
ROOT = Path(__file__).resolve().parents[2]


def test_no_c_source_left_in_python():
    """The C lives in csrc/ only: no Python file of the package has a C include line."""
    hits = [f"{p}:{i}" for p in (ROOT / "src").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "#include" in line]
    assert hits == []
    assert {"cpu_ops.c", "cpu_ops_avx512bf16.c", "gemv.c", "amx.h"} <= {p.name for p in (ROOT / "csrc/cpu").iterdir()}


@pytest.mark.parametrize("flags,expect", [
    (kernels.AVX512 | {"avx512_bf16"}, "cpu_ops_avx512bf16"),
    (kernels.AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "cpu_ops_avx512bf16"),  # AMX: same library
    (kernels.AVX512, "cpu_ops_avx512"),
    (kernels.AVX512 - {"avx512dq"}, None),
    (frozenset(), None),
])
def test_pick_variant_by_cpu_flags(flags, expect, tmp_path, monkeypatch):
    for name in ("cpu_ops_avx512", "cpu_ops_avx512bf16", "gemv"):
        (tmp_path / f"{name}.so").write_bytes(b"")
    monkeypatch.setenv("KVSERVE_KERNELS_DIR", str(tmp_path))
    assert kernels.pick_variant("cpu_ops", flags) == expect
    assert kernels.pick_variant("gemv", flags) == (None if expect is None else "gemv")


def test_pick_variant_takes_the_portable_build_when_the_bf16_one_is_missing(tmp_path, monkeypatch):
    (tmp_path / "cpu_ops_avx512.so").write_bytes(b"")
    monkeypatch.setenv("KVSERVE_KERNELS_DIR", str(tmp_path))
    assert kernels.pick_variant("cpu_ops", kernels.AVX512 | {"avx512_bf16"}) == "cpu_ops_avx512"
    assert kernels.pick_variant("gemv", kernels.AVX512) is None
    with pytest.raises(KeyError):
        kernels.pick_variant("nope")
    with pytest.raises(KeyError):
        kernels.load_library("nope")


@pytest.mark.skipif(not HAS_AVX512 or not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))
                    or kernels.kernels_disabled(),
                    reason="the kernels are built for x86-64 AVX-512 CPUs, with a C compiler (and not disabled)")
def test_the_install_built_every_variant_here():
    """On an AVX-512 machine with a compiler (the CI's), the install built all three libraries
    next to the package (src/kvserve/_C in an editable install; a build that failed silently
    would otherwise only show as skipped kernel tests) and the loader picked the CPU's best one."""
    d = kernels.lib_dir()
    assert {p.name for p in d.glob("*.so")} >= {"cpu_ops_avx512.so", "cpu_ops_avx512bf16.so", "gemv.so", "qgemv.so"}
    want = "cpu_ops_avx512bf16" if "avx512_bf16" in kernels.cpu_flags() else "cpu_ops_avx512"
    assert kernels.pick_variant("cpu_ops") == want
    assert Path(K._raw_lib()._name) == kernels.library_path(want)


def _run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


@needs_kernels
def test_kernels_load_with_no_compiler_on_path(tmp_path):
    """PATH holds only a link to the Python interpreter (no gcc, no cc) and CC is unset: the
    kernels still load, and an op gives the reference result. (The interpreter runs by its full
    path: a venv's Python must be started from its own bin/ to find its site-packages.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "KVSERVE_DISABLE_CPU_KERNELS")}
    env.update(PATH=str(bin_dir), HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = _run_python("""
        import shutil
        assert shutil.which("gcc") is None and shutil.which("cc") is None
        import torch
        from kvserve.kernels import cpu_ops as K
        from kvserve.worker.layers import linear
        assert K.available()
        k = linear.cpu_kernels()
        assert k is not None and k.has_f32
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 256, generator=g), torch.randn(256, generator=g)
        ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        torch.testing.assert_close(torch.ops.kvserve.rms_norm(x, w, 1e-5, None), ref, rtol=1e-5, atol=1e-5)
        lw = torch.randn(64, 256, generator=g)
        torch.testing.assert_close(linear.gemv(x, lw), x @ lw.T, rtol=1e-4, atol=1e-4)
        print("OK")
    """, env)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-3000:]
    assert not (tmp_path / "cache").exists()  # nothing compiled into a cache either


@needs_kernels
def test_loading_never_runs_a_compiler(tmp_path):
    """A fresh process that loads and runs every library starts no subprocess at all."""
    env = dict(os.environ, HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = _run_python("""
        import subprocess, os
        calls = []
        real = subprocess.Popen.__init__
        def spy(self, *a, **k):
            calls.append(a[0] if a else k.get("args"))
            return real(self, *a, **k)
        subprocess.Popen.__init__ = spy
        os.posix_spawn = os.posix_spawnp = lambda *a, **k: calls.append(a)
        import torch
        from kvserve.kernels import cpu_ops as K
        from kvserve.worker.layers import linear
        assert K.available() and linear.cpu_kernels() is not None
        K.silu_and_mul(torch.randn(2, 64))
        print("calls", calls)
    """, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "calls []"
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(not HAS_AVX512, reason="on a CPU without AVX-512 the loader does not look for libraries")
def test_no_built_library_falls_back_with_one_log_line(tmp_path):
    """With no library in the kernels directory (a build that produced none), the kernels are
    unavailable, the model path falls back to PyTorch, and exactly one warning line says so."""
    env = dict(os.environ, KVSERVE_KERNELS_DIR=str(tmp_path))
    env.pop("KVSERVE_DISABLE_CPU_KERNELS", None)
    r = _run_python("""
        import logging
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        import torch
        from kvserve.kernels import cpu_ops as K
        from kvserve.worker.layers import linear
        assert not K.available() and not K.available()
        assert linear.cpu_kernels() is None
        lin = linear.Linear(torch.randn(8, 16))
        x = torch.randn(1, 16)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
        try:
            K.rms_norm(x, torch.ones(16), 1e-5)
        except RuntimeError as e:
            print("raised", e)
    """, env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    names = "cpu_ops or gemv" + (" or qgemv" if "avx512_vnni" in kernels.cpu_flags() else "")
    assert lines[0].startswith(f"WARNING kvserve.kernels: kvserve: no CPU kernel library for {names} in "
                               f"{tmp_path}") and "PyTorch ops" in lines[0]
    assert r.stdout.startswith("raised kvserve CPU kernels are not available here")


def test_disabled_by_environment_loads_nothing_and_logs_nothing(monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_DISABLE_CPU_KERNELS", "1")
    with caplog.at_level(logging.DEBUG, logger="kvserve.kernels"):
        assert kernels.load_library("cpu_ops") is None and kernels.load_library("gemv") is None
    assert caplog.records == []


# ------------------------------------------------------------------ the torch.library ops

def test_every_kernel_function_is_a_registered_op():
    for name in K.OPS:
        assert hasattr(K, name)
        op = getattr(torch.ops.kvserve, name)
        assert op.default._schema.name == f"kvserve::{name}"
    assert {"cpu_gemv", "cpu_gemv_int8"} <= {n for n in dir(torch.ops.kvserve) if not n.startswith("_")}


def _opcheck_cases():
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    x = torch.randn(3, 64, generator=g).to(bf)
    w = torch.randn(64, generator=g).to(bf)
    T, H, KVH, hd, bs, nb = 2, 4, 2, 32, 16, 4
    qkv = torch.randn(T, (H + 2 * KVH) * hd, generator=g)
    pos = torch.tensor([0, 5])
    cos, sin = torch.randn(8, hd, generator=g), torch.randn(8, hd, generator=g)
    kc, vc = torch.zeros(nb, bs, KVH, hd), torch.zeros(nb, bs, KVH, hd)
    k, v = qkv[:, H * hd:(H + KVH) * hd].view(T, KVH, hd), qkv[:, (H + KVH) * hd:].view(T, KVH, hd)
    q = torch.randn(T, H, hd, generator=g)
    return {
        "rms_norm": (x, w, 1e-5, torch.randn(3, 64, generator=g).to(bf)),
        "silu_and_mul": (x,),
        "gemma_add_rms_norm_": (x, w, torch.randn(3, 64, generator=g).to(bf), 1e-6, w),
        "rope_": (qkv, H + KVH, hd, pos, cos, sin),
        "greedy": (torch.randn(2, 100, generator=g),),
        "reshape_and_cache": (k.contiguous(), v.contiguous(), kc, vc, torch.tensor([1, 17])),
        "paged_attention_decode": (q, torch.randn(nb, bs, KVH, hd, generator=g),
                                   torch.randn(nb, bs, KVH, hd, generator=g), torch.tensor([[2, 0], [1, 3]]),
                                   torch.tensor([5, 20]), hd**-0.5, torch.empty(T, H, hd), 20, None),
    }


@needs_kernels
@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    """torch.library.opcheck: the schema's mutation annotations hold, the fake implementation
    matches the real one's shapes, and the op traces under AOT dispatch (torch.compile)."""
    torch.library.opcheck(getattr(torch.ops.kvserve, name), _opcheck_cases()[name],
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_kernels
def test_gemv_kernels_come_from_the_built_library():
    assert linear.cpu_kernels() is not None and kernels.library_path("gemv").is_file()
    x, w = torch.randn(2, 128), torch.randn(32, 128)
    torch.testing.assert_close(torch.ops.kvserve.cpu_gemv(x, w, None), x @ w.T, rtol=1e-4, atol=1e-4)
