"""The peer-benchmark scripts (issue #22): benchmarks/peers/serve_table.py's table and ratios, and
the clear errors of benchmarks/peers/*.py, benchmarks/throughput.py's vLLM runner and
benchmarks/serve_vs_peers.sh on bad input. No model is loaded and vLLM is not needed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


serve_table = _load("serve_table", BENCH / "peers" / "serve_table.py")
gguf_to_hf = _load("gguf_to_hf", BENCH / "peers" / "gguf_to_hf.py")


def _result(tok_s: float, p99_ttft_ms: float, failed: int | None = None) -> dict:
    r = {"output_throughput": tok_s, "p99_ttft_ms": p99_ttft_ms, "median_ttft_ms": p99_ttft_ms / 2, "completed": 8}
    if failed is not None:
        r["failed"] = failed
    return r


def _write(folder: Path, runs: dict[str, dict]) -> None:
    for name, r in runs.items():
        (folder / name).write_text(json.dumps(r))


def test_serve_table_rows_and_ratios(tmp_path):
    _write(tmp_path, {
        "kvserve_kvserve-bench_c1.json": _result(72.0, 120.0, failed=0),
        "kvserve_vllm-bench_c1.json": _result(70.0, 130.0),
        "kvserve_kvserve-bench_c32.json": _result(500.0, 2000.0, failed=0),
        "kvserve_vllm-bench_c32.json": _result(480.0, 2100.0),
        "vllm_kvserve-bench_c1.json": _result(36.0, 240.0, failed=1),
        "vllm_vllm-bench_c1.json": _result(35.0, 260.0),
        "vllm_kvserve-bench_c32.json": _result(250.0, 4000.0, failed=0),
        # vllm bench at c=32 against vLLM is missing: its cells and ratios are "-"
        "notes.json": {"ignored": True},
        "kvserve.log": "x",
    })
    (tmp_path / "kvserve.log").write_text("not a result")
    res = serve_table.load(tmp_path)
    assert set(res) == {("kvserve", "kvserve-bench", 1), ("kvserve", "vllm-bench", 1),
                        ("kvserve", "kvserve-bench", 32), ("kvserve", "vllm-bench", 32),
                        ("vllm", "kvserve-bench", 1), ("vllm", "vllm-bench", 1), ("vllm", "kvserve-bench", 32)}
    lines = serve_table.table(res).splitlines()
    assert "| kvserve | 1 | 72.0 | 120 | 70.0 | 130 |" in lines
    assert "| kvserve | 32 | 500.0 | 2000 | 480.0 | 2100 |" in lines
    assert "| vllm | 1 | 36.0 (1 failed) | 240 | 35.0 | 260 |" in lines
    assert "| vllm | 32 | 250.0 | 4000 | - | - |" in lines
    # kvserve rows come first, then vLLM
    assert lines.index("| kvserve | 1 | 72.0 | 120 | 70.0 | 130 |") < lines.index("| vllm | 1 | 36.0 (1 failed) | 240 | 35.0 | 260 |")
    assert any(line.startswith("kvserve / vllm") for line in lines)
    assert "| 1 | 2.00x | 0.50x | 2.00x | 0.50x |" in lines
    assert "| 32 | 2.00x | 0.50x | - | - |" in lines


def test_serve_table_quantized_kvserve_gets_its_own_rows_and_ratios(tmp_path):
    """kvserve-q4 (Q4_1 weights kept quantized) sits between kvserve and the peers, is no peer of
    kvserve, and gets its own ratios against each peer."""
    _write(tmp_path, {
        "kvserve_kvserve-bench_c8.json": _result(300.0, 600.0),
        "kvserve-q4_kvserve-bench_c8.json": _result(450.0, 400.0),
        "vllm_kvserve-bench_c8.json": _result(150.0, 800.0),
    })
    lines = serve_table.table(serve_table.load(tmp_path)).splitlines()
    rows = [ln.split(" | ")[0] for ln in lines if ln.startswith("| kvserve") or ln.startswith("| vllm")]
    assert rows == ["| kvserve", "| kvserve-q4", "| vllm"]
    heads = [ln for ln in lines if " / " in ln and ln.endswith("faster):")]
    assert [h.split(" (")[0] for h in heads] == ["kvserve / vllm", "kvserve-q4 / vllm"]
    i = lines.index(heads[1])
    assert "| 8 | 3.00x | 0.50x | - | - |" == lines[i + 4]
    assert not any(ln.startswith("kvserve / kvserve-q4") for ln in lines)


def test_serve_table_main_errors(tmp_path, capsys):
    assert serve_table.main([str(tmp_path / "missing")]) == 2
    assert "RESULTS_DIR" in capsys.readouterr().err
    assert serve_table.main([str(tmp_path)]) == 1
    assert "no SYSTEM_" in capsys.readouterr().err
    _write(tmp_path, {"kvserve_kvserve-bench_c8.json": _result(300.0, 600.0)})
    assert serve_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| kvserve | 8 | 300.0 | 600 | - | - |" in out


def test_gguf_to_hf_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32, got 'int8'"):
        gguf_to_hf.convert(tmp_path / "x.gguf", tmp_path / "out", "int8")
    with pytest.raises(FileNotFoundError, match="gguf: no such file"):
        gguf_to_hf.convert(tmp_path / "x.gguf", tmp_path / "out")
    assert gguf_to_hf.main([str(tmp_path / "out"), "--gguf", str(tmp_path / "x.gguf")]) == 2
    assert "gguf: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gguf_to_hf.main([str(tmp_path / "out"), "--dtype", "int8"])


def test_gguf_to_hf_leaves_a_complete_folder(tmp_path, capsys):
    for f in gguf_to_hf.NEEDED:
        (tmp_path / f).write_text("{}")
    # no --gguf and no conversion: a complete folder is left as is
    assert gguf_to_hf.main([str(tmp_path), "--gguf", str(tmp_path / "absent.gguf")]) == 0
    assert "already converted" in capsys.readouterr().out
    assert (tmp_path / "model.safetensors").read_text() == "{}"


def test_vllm_offline_rejects_a_mismatched_workload(tmp_path):
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "prompts": [[1, 2]], "outs": [4, 4],
                              "max_model_len": 64, "max_num_seqs": 4}))
    p = subprocess.run([sys.executable, str(BENCH / "peers" / "vllm_offline.py"), "--workload", str(wl),
                        "--out", str(tmp_path / "o.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "1 prompts but 2 outs" in p.stderr


def test_throughput_run_vllm_names_the_missing_install(tmp_path):
    throughput = _load("throughput_bench", BENCH / "throughput.py")
    with pytest.raises(FileNotFoundError, match="--vllm-venv: .*install_vllm_cpu.sh"):
        throughput.run_vllm(tmp_path / "venv", tmp_path / "model", "bfloat16", [[1]], [1], 100)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    with pytest.raises(FileNotFoundError, match="--vllm-model: .*config.json"):
        throughput.run_vllm(tmp_path / "venv", tmp_path / "model", "bfloat16", [[1]], [1], 100)
    with pytest.raises(SystemExit):
        throughput.main(["--vllm", "--device", "cuda"])


@pytest.mark.parametrize("env,message", [
    ({"CONCURRENCIES": "1 0"}, "CONCURRENCIES must be integers >= 1, got '0'"),
    ({"SYSTEMS": "kvserve sglang"}, "SYSTEMS: unknown system 'sglang'"),
    ({"OUTPUT_LEN": "-3"}, "OUTPUT_LEN must be an integer >= 1, got '-3'"),
    ({"NUM_PROMPTS": "x"}, "NUM_PROMPTS must be an integer >= 1, got 'x'"),
])
def test_serve_vs_peers_rejects_bad_settings(env, message):
    p = subprocess.run(["bash", str(BENCH / "serve_vs_peers.sh"), "bench"], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=60)
    assert p.returncode == 2
    assert message in p.stderr


def test_install_vllm_refuses_a_venv_inside_the_repo():
    p = subprocess.run(["bash", str(BENCH / "peers" / "install_vllm_cpu.sh")], capture_output=True, text=True,
                       env={**os.environ, "VLLM_VENV": str(REPO / "vllm-venv")}, timeout=60)
    assert p.returncode == 2
    assert "VLLM_VENV must lie outside the repository" in p.stderr
    assert not (REPO / "vllm-venv").exists()


def test_vllm_env_lines(tmp_path):
    """vllm_env.sh: the venv's libiomp5.so and tcmalloc preloaded, threads on every core, no core
    reserved, 1 GiB of KV cache; a venv without libiomp5.so is named."""
    script = str(BENCH / "peers" / "vllm_env.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    p = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60,
                       env={**env, "VLLM_VENV": str(tmp_path / "none")})
    assert p.returncode == 1
    assert "not found: run benchmarks/peers/install_vllm_cpu.sh" in p.stderr
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    for _ in range(5):  # ldconfig | awk once exited 141 (SIGPIPE under pipefail) now and then
        p = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60,
                           env={**env, "VLLM_VENV": str(tmp_path / "venv")})
        tcmalloc = subprocess.run("ldconfig -p | grep -c 'libtcmalloc_minimal.so.4 '", shell=True,
                                  capture_output=True, text=True).stdout.strip()
        if tcmalloc in ("", "0"):
            assert p.returncode == 1 and "tcmalloc not found" in p.stderr
            continue
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        assert lines[0].startswith("export LD_PRELOAD=/") and "libtcmalloc_minimal.so.4:" in lines[0]
        assert lines[0].endswith(f":{tmp_path}/venv/lib/libiomp5.so")
        assert lines[1:] == [f"export VLLM_CPU_OMP_THREADS_BIND=0-{len(os.sched_getaffinity(0)) - 1}",
                             "export VLLM_CPU_NUM_OF_RESERVED_CPU=0", "export VLLM_CPU_KVCACHE_SPACE=1"]
