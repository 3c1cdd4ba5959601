"""The prefix cache's disk tier end to end (``kv_offload_dir`` / ``kv_offload_gib``), on the tiny
random Llama in float32: blocks evicted from memory are read back from disk with outputs equal to
a cold run (token-exact), a new engine on the same directory computes only the uncached tokens,
corrupt / truncated / foreign files are refused and the engine recomputes, the byte budget, tenant
isolation, the Prometheus counters and the bad-input errors."""

from __future__ import annotations

import logging
import os
import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.distributed.kv_transfer.disk_connector import HEADER_BYTES, block_file_name

NUM_BLOCKS = 20  # 320 tokens: a second 200-token prompt evicts most of the first's blocks
PARAMS = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 383) for _ in range(n)]


A, B = _prompt(1), _prompt(2)
A_FULL_BLOCKS = 12  # 199 tokens may come from a cache (the last is computed): 12 blocks of 16


@pytest.fixture(scope="module")
def reference(llama):
    """Cold outputs (no prefix cache at all) of A and B."""
    llm = LLM(model=llama, dtype="float32", num_blocks=64, enable_prefix_caching=False)
    outs = {name: llm.generate([p], PARAMS)[0].outputs[0] for name, p in (("A", A), ("B", B))}
    llm.shutdown()
    out = {name: o.token_ids for name, o in outs.items()}
    out["A_text"] = outs["A"].text
    return out


def _llm(model: str, directory, gib: float = 0.05, **kw) -> LLM:
    return LLM(model=model, dtype="float32", num_blocks=NUM_BLOCKS, kv_offload_dir=str(directory),
               kv_offload_gib=gib, **kw)


def _files(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".kvb"))


def _keys(llm: LLM, prompt: list[int], n: int = A_FULL_BLOCKS, cache_salt=None) -> list[bytes]:
    """The disk keys of the first ``n`` blocks of ``prompt`` in ``llm``'s tier."""
    kv = llm.engine.core.kv
    ns = kv.namespace(type("R", (), {"adapter_id": None, "cache_salt": cache_salt})())
    return kv.offload.chain(kv.offload.seed(ns), prompt, 0, n)


def _write_a(llama, directory, reference) -> list[bytes]:
    """Run A on an engine over ``directory`` and shut it down (A's blocks written); A's keys."""
    llm = _llm(llama, directory)
    assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]
    keys = _keys(llm, A)
    llm.shutdown()
    assert set(_files(directory)) == {block_file_name(k, 0) for k in keys}
    return keys


def test_evicted_prefix_is_read_back_from_disk_token_exact(llama, reference, tmp_path):
    llm = _llm(llama, tmp_path)
    assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]
    s = llm.engine.stats()
    assert s["kv_offload_written_blocks"] == 0 and s["kv_offload_blocks"] == 0  # nothing evicted yet
    assert llm.generate([B], PARAMS)[0].outputs[0].token_ids == reference["B"]
    llm.engine.flush_kv_offload()  # (the writes done and counted)
    s = llm.engine.stats()
    evicted = s["prefix_cache_evicted_blocks"]
    assert evicted > 0 and s["kv_offload_written_blocks"] == evicted and s["kv_offload_read_blocks"] == 0
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"]
    # A's last blocks were evicted (LRU trims a leaf from its end): memory serves the first ones,
    # the disk the rest, up to the 12 full blocks a 200-token prompt may take from a cache
    assert s["kv_offload_hits"] == 1 and 0 < s["kv_offload_read_blocks"] <= A_FULL_BLOCKS
    assert out.num_cached_tokens == A_FULL_BLOCKS * 16
    assert s["kv_offload_read_failed"] == 0
    llm.engine.core.kv.check_invariants()
    llm.shutdown()  # the writes are done once shut down: one file per block recorded
    assert len(_files(tmp_path)) == llm.engine.stats()["kv_offload_blocks"]


def test_a_new_engine_on_the_directory_computes_only_the_uncached_tokens(llama, reference, tmp_path):
    _write_a(llama, tmp_path, reference)
    llm = _llm(llama, tmp_path)
    s = llm.engine.stats()
    assert s["kv_offload_scanned_blocks"] == A_FULL_BLOCKS == s["kv_offload_blocks"]
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"]
    assert out.num_cached_tokens == A_FULL_BLOCKS * 16
    assert s["kv_offload_read_blocks"] == A_FULL_BLOCKS and s["kv_offload_hits"] == 1
    assert s["prompt_tokens_computed"] == len(A) - A_FULL_BLOCKS * 16  # 8 tokens, not 200
    # the loaded blocks are ordinary cached blocks now: the same prompt again hits memory only
    again = llm.generate([A], PARAMS)[0]
    assert again.outputs[0].token_ids == reference["A"] and again.num_cached_tokens == A_FULL_BLOCKS * 16
    assert llm.engine.stats()["kv_offload_read_blocks"] == A_FULL_BLOCKS
    # another tenant (cache_salt) does not see them, on disk or in memory
    eng = llm.engine  # (LLM.generate takes no salt)
    rid = eng.add_request(A, PARAMS, cache_salt="tenant-b")
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[0].request_id == rid and outs[0].num_cached_tokens == 0
    assert outs[0].outputs[0].token_ids == reference["A"]
    assert eng.stats()["kv_offload_read_blocks"] == A_FULL_BLOCKS
    llm.shutdown()


def _flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_corrupt_file_is_refused_and_the_prompt_recomputed(llama, reference, tmp_path, caplog):
    keys = _write_a(llama, tmp_path, reference)
    bad = tmp_path / block_file_name(keys[5], 0)
    _flip_payload_byte(str(bad))
    llm = _llm(llama, tmp_path)
    assert llm.engine.stats()["kv_offload_scanned_blocks"] == A_FULL_BLOCKS  # (headers are fine)
    with caplog.at_level(logging.WARNING):
        out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"]
    assert s["kv_offload_read_failed"] == 1 and s["kv_offload_read_blocks"] == 0 and s["kv_offload_hits"] == 0
    assert s["prompt_tokens_computed"] == len(A) and out.num_cached_tokens == 0
    assert "payload checksum mismatch" in caplog.text and "corrupt" in caplog.text
    assert not bad.exists()
    llm.engine.core.kv.check_invariants()
    llm.shutdown()


def test_a_truncated_file_is_refused_at_start(llama, reference, tmp_path, caplog):
    keys = _write_a(llama, tmp_path, reference)
    cut = tmp_path / block_file_name(keys[5], 0)
    os.truncate(cut, os.path.getsize(cut) - 7)
    with caplog.at_level(logging.WARNING):
        llm = _llm(llama, tmp_path)
    assert "1 truncated block file(s) deleted" in caplog.text and not cut.exists()
    assert llm.engine.stats()["kv_offload_scanned_blocks"] == A_FULL_BLOCKS - 1
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"]
    assert s["kv_offload_read_blocks"] == 5 and out.num_cached_tokens == 5 * 16  # the chain stops at the hole
    assert s["prompt_tokens_computed"] == len(A) - 5 * 16
    llm.shutdown()


def test_a_truncated_file_found_at_read_is_refused(llama, reference, tmp_path):
    keys = _write_a(llama, tmp_path, reference)
    llm = _llm(llama, tmp_path)
    cut = tmp_path / block_file_name(keys[3], 0)
    os.truncate(cut, HEADER_BYTES + 10)  # (after the start-up scan)
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"] and s["kv_offload_read_failed"] == 1
    assert s["prompt_tokens_computed"] == len(A) and not cut.exists()
    llm.shutdown()


def test_another_models_files_are_foreign(llama, reference, tmp_path, tmp_path_factory, caplog):
    from tiny_models import make_model

    other = tmp_path_factory.mktemp("tiny-llama-seed1")
    make_model(other, "llama", seed=1)  # the same shapes, other weights: another fingerprint
    keys = _write_a(llama, tmp_path, reference)
    o = _llm(str(other), tmp_path)
    assert o.engine.stats()["kv_offload_scanned_blocks"] == 0  # ours are foreign to it
    o.generate([A], PARAMS)
    other_keys = _keys(o, A)
    o.shutdown()
    assert not set(other_keys) & set(keys)  # the fingerprint is in every key
    assert len(_files(tmp_path)) == 2 * A_FULL_BLOCKS  # (neither deleted the other's files)
    # a file of the other model under the name of our block 0: its header says foreign
    os.replace(tmp_path / block_file_name(other_keys[0], 0), tmp_path / block_file_name(keys[0], 0))
    with caplog.at_level(logging.WARNING):
        llm = _llm(llama, tmp_path)
    assert "foreign block file(s) skipped" in caplog.text and "model fingerprint" in caplog.text
    assert llm.engine.stats()["kv_offload_scanned_blocks"] == A_FULL_BLOCKS - 1
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"]
    assert s["kv_offload_read_blocks"] == 0 and s["prompt_tokens_computed"] == len(A)  # the chain starts at block 0
    assert (tmp_path / block_file_name(keys[0], 0)).exists()  # skipped, not deleted
    llm.shutdown()


def test_a_dtype_change_makes_the_files_foreign(llama, reference, tmp_path):
    _write_a(llama, tmp_path, reference)
    llm = LLM(model=llama, dtype="bfloat16", num_blocks=NUM_BLOCKS, kv_offload_dir=str(tmp_path), kv_offload_gib=0.05)
    assert llm.engine.stats()["kv_offload_scanned_blocks"] == 0
    llm.shutdown()


def test_the_byte_budget_keeps_the_most_recent_blocks(llama, reference, tmp_path):
    probe = _llm(llama, tmp_path / "probe")
    file_bytes = probe.engine.core.kv.offload.block_file_bytes
    probe.shutdown()
    llm = _llm(llama, tmp_path / "t", gib=4.5 * file_bytes / (1 << 30))
    assert llm.engine.stats()["kv_offload_capacity_blocks"] == 4
    for p in (A, B, _prompt(3)):
        llm.generate([p], PARAMS)
    llm.engine.flush_kv_offload()
    s = llm.engine.stats()
    assert s["kv_offload_written_blocks"] > 4 and s["kv_offload_blocks"] == 4
    assert s["kv_offload_deleted_blocks"] == s["kv_offload_written_blocks"] - 4
    assert len(_files(tmp_path / "t")) == 4
    llm.shutdown()
    assert len(_files(tmp_path / "t")) == 4  # (the blocks still cached at shutdown did not push past it)


def test_a_smaller_budget_at_start_deletes_the_oldest_files(llama, reference, tmp_path):
    keys = _write_a(llama, tmp_path, reference)
    for i, k in enumerate(keys):  # block i written at time i (the LRU order a restart rebuilds)
        os.utime(tmp_path / block_file_name(k, 0), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    probe = _llm(llama, tmp_path / "probe")
    file_bytes = probe.engine.core.kv.offload.block_file_bytes
    probe.shutdown()
    llm = _llm(llama, tmp_path, gib=5.5 * file_bytes / (1 << 30))
    s = llm.engine.stats()
    assert s["kv_offload_scanned_blocks"] == A_FULL_BLOCKS and s["kv_offload_blocks"] == 5
    assert set(_files(tmp_path)) == {block_file_name(k, 0) for k in keys[-5:]}
    llm.shutdown()
    with pytest.raises(ValueError, match="kv_offload_gib=1e-09 holds no KV block file"):
        _llm(llama, tmp_path, gib=1e-9)


def test_prometheus_counters(llama, reference, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.entrypoints.openai.async_engine import AsyncEngine
    from kvserve.entrypoints.openai.metrics import ServerMetrics

    _write_a(llama, tmp_path, reference)
    llm = _llm(llama, tmp_path)
    llm.generate([A], PARAMS)
    llm.generate([B], PARAMS)  # evicts A's blocks: written? they are on disk already (no rewrite)
    llm.engine.flush_kv_offload()
    metrics = ServerMetrics("tiny")
    AsyncEngine(llm.engine, metrics)._update_gauges()
    values = {x.name: x.value for fam in text_string_to_metric_families(metrics.render().decode()) for x in fam.samples}
    s = llm.engine.stats()
    assert values["kvserve:kv_offload_read_blocks_total"] == s["kv_offload_read_blocks"] == A_FULL_BLOCKS
    assert values["kvserve:kv_offload_hits_total"] == s["kv_offload_hits"] == 1
    assert values["kvserve:kv_offload_written_blocks_total"] == s["kv_offload_written_blocks"]
    assert values["kvserve:kv_offload_read_failures_total"] == 0
    llm.shutdown()


@pytest.mark.parametrize("kw, words", [
    (dict(kv_offload_gib=0), "kv_offload_gib must be a number of GiB in (0, 1048576], got 0"),
    (dict(kv_offload_gib=-1.5), "kv_offload_gib must be a number of GiB in (0, 1048576], got -1.5"),
    (dict(kv_offload_gib=float("nan")), "kv_offload_gib must be a number of GiB in (0, 1048576], got nan"),
    (dict(kv_offload_gib="2"), "kv_offload_gib must be a number of GiB in (0, 1048576], got '2'"),
    (dict(kv_offload_gib=None), "kv_offload_dir needs kv_offload_gib"),
    (dict(kv_offload_gib=1, enable_prefix_caching=False), "kv_offload_dir: the disk tier extends the prefix cache"),
])
def test_bad_options_are_named(kw, words, tmp_path):
    with pytest.raises(ValueError) as e:
        LLM(model=str(tmp_path / "nope.gguf"), kv_offload_dir=str(tmp_path / "d"), **kw)
    assert words in str(e.value)


def test_an_unwritable_directory_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"kv_offload_dir: cannot create or write the directory .*file/sub"):
        LLM(model=str(tmp_path / "nope.gguf"), kv_offload_dir=str(tmp_path / "file" / "sub"), kv_offload_gib=1)
    with pytest.raises(ValueError, match="kv_offload_gib needs kv_offload_dir"):
        LLM(model=str(tmp_path / "nope.gguf"), kv_offload_gib=1)


@pytest.mark.parametrize("argv, words", [
    (["--kv-offload-dir", "{d}", "--kv-offload-gib", "0"], "--kv-offload-gib must be a number of GiB in (0, 1048576], got 0.0"),
    (["--kv-offload-dir", "{d}"], "--kv-offload-dir needs --kv-offload-gib"),
    (["--kv-offload-dir", "{f}/sub", "--kv-offload-gib", "1"], "--kv-offload-dir: cannot create or write the directory"),
])
def test_cli_names_the_flag(argv, words, tmp_path, capsys):
    from kvserve.entrypoints.cli import main

    (tmp_path / "f").write_text("x")
    argv = [a.format(d=tmp_path / "d", f=tmp_path / "f") for a in argv]
    assert main(["generate", "hi", "--model", str(tmp_path / "nope.gguf")] + argv) == 2
    assert words in capsys.readouterr().err


def test_tensor_parallel_ranks_write_and_read_their_own_shards(llama, reference, tmp_path):
    """At ``tensor_parallel_size=2`` each rank writes its shard (``<key>.r0.kvb``, ``.r1.kvb``); a
    restarted engine reads both back; a corrupt shard of one rank fails the read on every rank
    (the request recomputes, the block's files go on both ranks). On the CPU (gloo ranks): a
    one-GPU machine has no second CUDA device."""
    llm = _llm(llama, tmp_path, tensor_parallel_size=2, device="cpu")
    assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]
    keys = _keys(llm, A)
    llm.shutdown()
    assert set(_files(tmp_path)) == {block_file_name(k, r) for k in keys for r in (0, 1)}
    llm = _llm(llama, tmp_path, tensor_parallel_size=2, device="cpu")
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"] and out.num_cached_tokens == A_FULL_BLOCKS * 16
    assert s["kv_offload_read_blocks"] == A_FULL_BLOCKS and s["prompt_tokens_computed"] == len(A) - A_FULL_BLOCKS * 16
    llm.shutdown()
    _flip_payload_byte(str(tmp_path / block_file_name(keys[7], 1)))
    llm = _llm(llama, tmp_path, tensor_parallel_size=2, device="cpu")
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == reference["A"] and s["kv_offload_read_failed"] == 1
    assert s["prompt_tokens_computed"] == len(A)
    llm.engine.core.executor.collective_rpc("flush_kv_offload")  # (the deletions done)
    assert not {block_file_name(k, r) for k in keys for r in (0, 1)} & set(_files(tmp_path))
    llm.shutdown()


def test_a_server_core_process_reads_the_prefix_from_disk(llama, reference, tmp_path):
    """The server path (the engine core in its own process, as ``kvserve serve``) on a directory an
    earlier engine wrote: A's prefix comes from disk, the completion equals the cold one, and
    ``/metrics`` counts it. (That a stopping server's core writes its cache: the ``shutdown`` of
    the tests above, and benchmarks/kv_offload_restart.py against real ``kvserve serve`` restarts.)"""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_helpers import ServerThread

    from kvserve.engine.args import EngineArgs

    _write_a(llama, tmp_path, reference)
    args = EngineArgs(model=llama, dtype="float32", num_blocks=NUM_BLOCKS, kv_offload_dir=str(tmp_path),
                      kv_offload_gib=0.05)
    with ServerThread(args, names=["tiny"]) as s:
        r = httpx.post(s.base_url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": A, "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        text = httpx.get(s.base_url + "/metrics", timeout=30).text
    m = {x.name: x.value for fam in text_string_to_metric_families(text) for x in fam.samples}
    assert r.json()["choices"][0]["text"] == reference["A_text"]
    assert m["kvserve:kv_offload_read_blocks_total"] == A_FULL_BLOCKS and m["kvserve:kv_offload_hits_total"] == 1
    assert m["kvserve:prefix_cache_hits_total"] == A_FULL_BLOCKS * 16
    assert m["kvserve:kv_offload_failed_writes_total"] == 0  # (exposed with the others)


def test_a_random_workload_with_disk_hits_equals_the_cold_outputs(llama, tmp_path):
    """Waves of prompts over three shared prefixes taking turns, through a pool too small for all
    three, with chunked prefill (64 tokens a step): every output equals the cold one, prefixes came
    back from disk, and the books stay consistent."""
    rng = random.Random(7)
    prefixes = [_prompt(10 + i, rng.randrange(100, 140)) for i in range(3)]
    waves = [[prefixes[w % 3] + _prompt(100 + 3 * w + i, rng.randrange(5, 30)) for i in range(2)] for w in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cold = LLM(model=llama, dtype="float32", num_blocks=128, enable_prefix_caching=False)
    expected = [[o.outputs[0].token_ids for o in cold.generate(w, params)] for w in waves]
    cold.shutdown()
    llm = LLM(model=llama, dtype="float32", num_blocks=24, max_num_batched_tokens=64, kv_offload_dir=str(tmp_path),
              kv_offload_gib=0.05)
    for wave, want in zip(waves, expected):
        assert [o.outputs[0].token_ids for o in llm.generate(wave, params)] == want
        llm.engine.core.kv.check_invariants()
    s = llm.engine.stats()
    assert s["kv_offload_hits"] >= 3 and s["kv_offload_read_blocks"] >= 12 and s["kv_offload_read_failed"] == 0
    llm.shutdown()


# ---------------------------------------------------------------- the directory going away while serving


def _flush(llm: LLM) -> None:
    """Wait for the disk tier's writes (the next stats() counts them all)."""
    llm.engine.core.executor.collective_rpc("flush_kv_offload")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _writer_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("kvserve-disk-writer")]


def test_a_directory_deleted_while_serving_is_recreated_token_exact(llama, reference, tmp_path, caplog):
    """DIR deleted under a running engine: the read of A's blocks finds it gone (A recomputes,
    token-exact), the directory is recreated, the next writes go there, and B's blocks come back
    from it; every write counted as written, none failed; two warning lines, no traceback."""
    import shutil

    d = tmp_path / "t"
    llm = _llm(llama, d)
    assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]
    assert llm.generate([B], PARAMS)[0].outputs[0].token_ids == reference["B"]  # A's last blocks to disk
    _flush(llm)
    assert llm.engine.stats()["kv_offload_written_blocks"] > 0
    shutil.rmtree(d)
    with caplog.at_level(logging.WARNING):
        assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]  # evicts B's blocks
        assert llm.generate([B], PARAMS)[0].outputs[0].token_ids == reference["B"]  # B's from the new directory
        _flush(llm)
    s = llm.engine.stats()
    assert d.is_dir()
    assert s["kv_offload_written_blocks"] == s["prefix_cache_evicted_blocks"]  # (no block evicted twice here)
    assert (s["kv_offload_failed_writes"], s["kv_offload_pending_writes"], s["kv_offload_writes_disabled"]) == (0, 0, 0)
    assert s["kv_offload_read_failed"] == 1 and s["kv_offload_hits"] == 1  # A's read failed, B's came back
    assert sorted(_files(d)) == sorted(block_file_name(k, 0) for k in llm.engine.core.kv.offload.index)
    messages = _warnings(caplog)
    assert len(messages) <= 3 and sum("was gone" in m for m in messages) == 1, messages
    assert not any(r.exc_info for r in caplog.records)
    llm.engine.core.kv.check_invariants()
    llm.shutdown()


def test_a_directory_replaced_by_a_file_while_serving(llama, reference, tmp_path, caplog):
    """DIR replaced by a regular file under a running engine: one warning, the writes off, the
    blocks that were on disk misses, outputs token-exact, exact counters (also in /metrics), a
    silent shutdown."""
    import shutil

    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.entrypoints.openai.async_engine import AsyncEngine
    from kvserve.entrypoints.openai.metrics import ServerMetrics

    d = tmp_path / "t"
    llm = _llm(llama, d)
    llm.generate([A], PARAMS)
    llm.generate([B], PARAMS)
    _flush(llm)
    written = llm.engine.stats()["kv_offload_written_blocks"]
    assert written > 0
    shutil.rmtree(d)
    d.write_text("not a directory")
    tier = llm.engine.core.kv.offload
    with caplog.at_level(logging.WARNING):
        assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]  # its read fails: recomputed
        assert llm.generate([B], PARAMS)[0].outputs[0].token_ids == reference["B"]  # a miss: nothing on disk now
        _flush(llm)
    s = llm.engine.stats()
    assert s["kv_offload_written_blocks"] == written  # nothing more was really written
    failed = tier.num_recorded_writes - written  # (the writes recorded before the engine learnt it)
    assert s["kv_offload_failed_writes"] == failed > 0 and s["kv_offload_pending_writes"] == 0
    assert s["kv_offload_writes_disabled"] == 1 and s["kv_offload_blocks"] == 0
    assert s["kv_offload_read_failed"] == 1 and s["kv_offload_hits"] == 0
    messages = _warnings(caplog)
    assert len(messages) <= 3 and sum("cannot be recreated" in m for m in messages) == 1, messages
    assert not any(r.exc_info for r in caplog.records)
    metrics = ServerMetrics("tiny")
    AsyncEngine(llm.engine, metrics)._update_gauges()
    values = {x.name: x.value for fam in text_string_to_metric_families(metrics.render().decode()) for x in fam.samples}
    assert values["kvserve:kv_offload_failed_writes_total"] == failed
    assert values["kvserve:kv_offload_written_blocks_total"] == written
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvserve"):
        llm.shutdown()
    assert not _warnings(caplog) and not _writer_threads()
    assert d.read_text() == "not a directory"


def test_shutdown_onto_a_directory_replaced_by_a_file_is_quiet(llama, reference, tmp_path, caplog, capfd):
    """The first writes are the shutdown's (A's 12 cached blocks) and DIR is a file by then: one
    warning line, no traceback, the writer stopped, the blocks counted as failed writes."""
    import shutil

    d = tmp_path / "t"
    llm = _llm(llama, d)
    assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == reference["A"]
    shutil.rmtree(d)
    d.write_text("not a directory")
    caplog.clear()
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        llm.shutdown()
    s = llm.engine.stats()
    assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"], s["kv_offload_pending_writes"]) == (
        0, A_FULL_BLOCKS, 0)
    messages = _warnings(caplog)
    assert len(messages) == 1 and "cannot be recreated" in messages[0] and "0 block(s) on it are lost" in messages[0]
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err
    assert not _writer_threads() and d.read_text() == "not a directory"
