"""The prefix cache's disk tier with a 2-/4-bit KV cache (``kv_cache_dtype`` int4 / int2 with
``kv_offload_dir``), on the tiny random Llama in float32: full blocks evicted from memory are
written as the pools' packed codes and scales and read back with outputs token-exact to a cold
run with the same ``kv_cache_dtype``; a new engine on the directory reads them (computing only
the uncached tokens); files written with one KV dtype are foreign to an engine with another
(int4 vs int2 vs the float32 cache), never loaded into its pools."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve import LLM
from kvserve.distributed.kv_transfer.disk_connector import HEADER_BYTES, BlockFileError, BlockFileLayout

from test_kv_offload import A, A_FULL_BLOCKS, B, NUM_BLOCKS, PARAMS, _files, _keys
from kvserve.distributed.kv_transfer.disk_connector import block_file_name

LOWBIT = ("int4", "int2")


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def _llm(model, kv, directory=None, **kw) -> LLM:
    if directory is not None:
        kw.update(num_blocks=NUM_BLOCKS, kv_offload_dir=str(directory), kv_offload_gib=0.05)
    return LLM(model=model, dtype="float32", kv_cache_dtype=kv, **kw)


@pytest.fixture(scope="module")
def cold(llama):
    """Cold outputs (no prefix cache) of A and B per KV dtype."""
    out = {}
    for kv in LOWBIT:
        llm = _llm(llama, kv, num_blocks=64, enable_prefix_caching=False)
        out[kv] = {name: llm.generate([p], PARAMS)[0].outputs[0].token_ids for name, p in (("A", A), ("B", B))}
        llm.shutdown()
    return out


def _slots_back(llm) -> None:
    kv = llm.engine.core.kv
    kv.check_invariants()
    kv.residual.end_step()
    kv.check_invariants()
    assert kv.residual.num_free == kv.residual.num_slots and bool((kv.residual.map == -1).all())


@pytest.mark.parametrize("kv", LOWBIT)
def test_lowbit_blocks_go_to_disk_and_back_token_exact(llama, cold, kv, tmp_path):
    ref = cold[kv]
    llm = _llm(llama, kv, tmp_path)
    assert llm.generate([A], PARAMS)[0].outputs[0].token_ids == ref["A"]
    assert llm.generate([B], PARAMS)[0].outputs[0].token_ids == ref["B"]  # evicts most of A's blocks
    llm.engine.flush_kv_offload()  # (the writes done and counted)
    s = llm.engine.stats()
    assert s["prefix_cache_evicted_blocks"] > 0 and s["kv_offload_written_blocks"] == s["prefix_cache_evicted_blocks"]
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == ref["A"]
    assert s["kv_offload_hits"] == 1 and 0 < s["kv_offload_read_blocks"] <= A_FULL_BLOCKS
    assert out.num_cached_tokens == A_FULL_BLOCKS * 16 and s["kv_offload_read_failed"] == 0
    _slots_back(llm)
    llm.shutdown()
    files = _files(tmp_path)
    assert len(files) == llm.engine.stats()["kv_offload_blocks"] > 0
    # each file: header + 2 layers of packed K and V blocks of 2 KV heads, head_dim 16, block 16
    # (int4: K 128 codes + 64 params, V 128 + 64 bytes a head; int2: 64 + 64 and 64 + 64)
    per_head = {"int4": 192 + 192, "int2": 128 + 128}[kv]
    assert {os.path.getsize(tmp_path / f) for f in files} == {HEADER_BYTES + 2 * 2 * per_head}

    # a new engine on the directory reads A's 12 full blocks from disk: only the last 8 tokens computed
    llm = _llm(llama, kv, tmp_path)
    assert {block_file_name(k, 0) for k in _keys(llm, A)} <= set(files)  # (written at shutdown at the latest)
    assert llm.engine.stats()["kv_offload_scanned_blocks"] == len(files)
    out = llm.generate([A], PARAMS)[0]
    s = llm.engine.stats()
    assert out.outputs[0].token_ids == ref["A"] and s["kv_offload_read_failed"] == 0
    assert s["kv_offload_read_blocks"] == A_FULL_BLOCKS and out.num_cached_tokens == A_FULL_BLOCKS * 16
    assert s["prompt_tokens_computed"] == len(A) - A_FULL_BLOCKS * 16
    _slots_back(llm)
    llm.shutdown()


def test_files_of_one_kv_dtype_are_foreign_to_another(llama, cold, tmp_path):
    """int4 files: an int2 engine and a float32-cache engine on the directory scan none of them,
    read none (int2 computes A itself, its own cold tokens) and delete none; the header check names
    the dtype; an int4 engine finds them all again."""
    llm = _llm(llama, "int4", tmp_path)
    llm.generate([A], PARAMS)
    llm.shutdown()
    files = _files(tmp_path)
    assert len(files) == A_FULL_BLOCKS
    for other in ("int2", "auto"):
        o = _llm(llama, other, tmp_path)
        assert o.engine.stats()["kv_offload_scanned_blocks"] == 0
        if other == "int2":
            out = o.generate([A], PARAMS)[0]
            s = o.engine.stats()
            assert out.outputs[0].token_ids == cold["int2"]["A"]
            assert s["kv_offload_read_blocks"] == 0 and s["prompt_tokens_computed"] == len(A)
        o.shutdown()
        assert set(files) <= set(_files(tmp_path))  # skipped, never deleted
    llm = _llm(llama, "int4", tmp_path)
    assert llm.engine.stats()["kv_offload_scanned_blocks"] == A_FULL_BLOCKS
    llm.shutdown()
    # the header check alone (the same fingerprint, another KV dtype) refuses an int4 file, naming the dtype
    lay4 = BlockFileLayout(b"\0" * 16, 0, 1, 2, 16, 2, 16, torch.uint4)
    for dt in (torch.uint2, torch.bfloat16):
        with pytest.raises(BlockFileError, match="dtype") as e:
            BlockFileLayout(b"\0" * 16, 0, 1, 2, 16, 2, 16, dt).check_header(lay4.header(b"k" * 16, 0))
        assert e.value.kind == "foreign"


def test_lowbit_layout_parts_and_put_read_round_trip(tmp_path):
    """The 2-/4-bit layout's parts (K and V sizes differ), put → read_parts from memory and from
    the file give the same bytes; a whole-row shape is refused with a clear error."""
    from kvserve.distributed.kv_transfer.disk_connector import DiskKVConnector

    lay = BlockFileLayout(b"f" * 16, 0, 1, 2, 16, 2, 16, torch.uint2)
    assert lay.part_shapes() == ((2, 64 + 64), (2, 64 + 64)) and lay.payload_bytes == 2 * 2 * 256
    lay4 = BlockFileLayout(b"f" * 16, 0, 1, 2, 16, 2, 32, torch.uint4)  # V: 16 tokens x 1 group x 4 bytes
    assert lay4.part_shapes() == ((2, 256 + 128), (2, 256 + 64))
    with pytest.raises(ValueError, match="part_shapes"):
        lay4.shape
    conn = DiskKVConnector(str(tmp_path), lay4)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 256, (3, *lay4.part_shapes()[i % 2]), dtype=torch.uint8, generator=g) for i in range(4)]
    keys = [bytes([i]) * 16 for i in range(3)]
    conn.put(keys, parts)
    for _ in range(2):  # (queued, then from the files)
        got = conn.read_parts(keys[::-1])
        assert all(torch.equal(a, b.flip(0)) for a, b in zip(got, parts))
        conn.flush()
    with pytest.raises(ValueError, match=r"expected 4 parts \(3, 2, 384\) \(K\), \(3, 2, 320\) \(V\)"):
        conn.put(keys, [p[:, :1] for p in parts])
    conn.close()
