"""The disk tier's books and files without a model (kvserve.core.kv_offload,
kvserve.distributed.kv_transfer.disk_connector): the key chain, the ops an eviction and an
admission record, a byte-exact round trip through the files with local pools, the file checks
(corrupt, truncated, foreign, a rank's file missing), queued blocks served before their write."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_offload import KVOffloadTier
from kvserve.core.kv_ops import LOAD, OFFLOAD, KVCacheOps
from kvserve.core.request import Request
from kvserve.distributed.kv_transfer.disk_connector import (HEADER_BYTES, BlockFileError, BlockFileLayout,
                                                            DiskKVConnector, block_file_name, scan_directory)
from kvserve.sampling_params import SamplingParams

BS, LAYERS, HEADS, ROW = 4, 2, 2, 8
FP = bytes(range(16))


def _layout(dtype=torch.float32, fp=FP, tp=1, rank=0, heads=HEADS) -> BlockFileLayout:
    return BlockFileLayout(fp, rank, tp, LAYERS, BS, heads, ROW, dtype)


def _req(rid: str, prompt, salt=None) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=4),
                   seed=0, cache_salt=salt)


def _run(kv: KVCacheManager, req: Request) -> None:
    """Admit the request, 'compute' its prompt and free it (its full blocks stay cached)."""
    n = kv.admit(req, 1000)
    assert n > 0
    req.num_computed_tokens += n
    kv.cache_computed(req)
    kv.free(req)


def test_the_key_chain_covers_fingerprint_namespace_and_every_earlier_token(tmp_path):
    t = KVOffloadTier(str(tmp_path), 1, _layout(), KVCacheOps(), scan=False)
    other = KVOffloadTier(str(tmp_path), 1, _layout(fp=bytes(16)), KVCacheOps(), scan=False)
    ns = (("model", "m"), ("adapter", None), ("salt", None))
    toks = list(range(3, 3 + 4 * BS))
    keys = t.chain(t.seed(ns), toks, 0, 4)
    assert len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
    assert t.chain(keys[1], toks, 2, 2) == keys[2:]  # a chain continues from any block's key
    changed = [toks[0] + 1] + toks[1:]
    assert not set(t.chain(t.seed(ns), changed, 0, 4)) & set(keys)  # block 0's tokens reach every later key
    salted = (("model", "m"), ("adapter", None), ("salt", "x"))
    assert not set(t.chain(t.seed(salted), toks, 0, 4)) & set(keys)
    assert not set(other.chain(other.seed(ns), toks, 0, 4)) & set(keys)
    moved = (("model", "/elsewhere/m"), ("adapter", None), ("salt", None))
    assert t.chain(t.seed(moved), toks, 0, 4) == keys  # the fingerprint, not the path, names the model


def test_eviction_records_an_offload_and_admission_a_disk_load(tmp_path):
    tier = KVOffloadTier(str(tmp_path), 1, _layout(), KVCacheOps(), scan=False)
    kv = KVCacheManager(6, BS, True, None, offload=tier)  # no pools: the ops are recorded
    a = list(range(10, 10 + 4 * BS + 1))  # 4 full blocks + 1 token
    _run(kv, _req("a", a))
    kv.ops.take()
    assert kv.num_cached_blocks == 4
    _run(kv, _req("b", list(range(100, 100 + 4 * BS + 1))))  # needs 5 blocks of 6: evicts 3 of a's
    ops = kv.ops.take()
    off = [b for b in ops.batches if b.kind == OFFLOAD]
    keys = tier.chain(tier.seed(kv.namespace(_req("x", a))), a, 0, 4)
    assert len(off) == 1 and off[0].source == (tuple(keys[1:]), ())  # a leaf is trimmed from its end
    s = tier.stats()  # (recorded; written once a worker reports it: no worker here)
    assert len(off[0].src) == 3 and s["kv_offload_pending_writes"] == 3 and s["kv_offload_written_blocks"] == 0
    assert list(tier.index) == keys[1:]
    r = _req("a2", a)
    n = kv.admit(r, 1000)
    assert r.num_computed_tokens == 4 * BS and n == 1 and r.num_cached_tokens == 4 * BS
    load = [b for b in kv.ops.batches if b.kind == LOAD]
    assert len(load) == 1 and load[0].source.connector == "disk" and load[0].source.key == tuple(keys[1:])
    assert load[0].dst == kv.block_tables["a2"][1:4]
    assert kv.cache.match_prefix(kv.namespace(r), a, update_stats=False).num_blocks == 4  # in the tree now
    assert tier.stats()["kv_offload_read_blocks"] == 3
    kv.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_local_pools_round_trip_through_the_files_byte_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    pools = [tuple(torch.randn((6, BS, HEADS, ROW), generator=g).to(dtype) for _ in range(2)) for _ in range(LAYERS)]
    tier = KVOffloadTier(str(tmp_path), 1, _layout(dtype), KVCacheOps(), scan=False)
    kv = KVCacheManager(6, BS, True, pools, offload=tier)
    kv._mover.disk = DiskKVConnector(str(tmp_path), _layout(dtype))
    a = list(range(10, 10 + 4 * BS + 1))
    _run(kv, _req("a", a))
    table = list(kv.cache.match_prefix(kv.namespace(_req("x", a)), a, update_stats=False).blocks)
    saved = [[p[table].clone() for p in pair] for pair in pools]
    _run(kv, _req("b", list(range(100, 100 + 4 * BS + 1))))  # evicts 3 of a's blocks and overwrites them
    for pair in pools:
        for p in pair:
            p.view(torch.uint8).fill_(0)
    kv._mover.disk.flush()
    assert len(os.listdir(tmp_path)) == 3
    r = _req("a2", a)
    kv.admit(r, 1000)
    got = kv.block_tables["a2"][:4]
    for pair, before in zip(pools, saved):
        for p, b in zip(pair, before):
            assert torch.equal(p[got[1:]].view(torch.uint8), b[1:].view(torch.uint8))
    kv._mover.disk.close()


def test_queued_blocks_are_read_before_their_write_and_files_checked(tmp_path):
    lay = _layout()
    conn = DiskKVConnector(str(tmp_path), lay)
    x = torch.randn((3, *lay.shape))
    keys = [bytes([i]) * 16 for i in range(3)]
    conn.put(keys, x)
    assert torch.equal(conn.read(keys), x.transpose(0, 1))  # from memory or file: the same bytes
    conn.flush()
    assert not conn._pending and conn._pending_bytes == 0  # written: no longer held in memory
    assert sorted(os.listdir(tmp_path)) == sorted(block_file_name(k, 0) for k in keys)
    assert all(os.path.getsize(tmp_path / block_file_name(k, 0)) == lay.file_bytes for k in keys)
    assert torch.equal(conn.read(keys[::-1]), x.flip(0).transpose(0, 1))
    payload = conn.fetch(tuple(keys), 0, [2, 0])
    assert len(payload) == LAYERS and torch.equal(payload[1][0], x[[2, 0], 2]) and torch.equal(payload[1][1], x[[2, 0], 3])
    conn.delete(keys[:1])
    conn.flush()
    assert not (tmp_path / block_file_name(keys[0], 0)).exists()
    from kvserve.distributed.kv_transfer import KVTransferError

    with pytest.raises(KVTransferError, match="FileNotFoundError"):
        conn.read(keys[:1])
    conn.close()


def test_headers_refuse_corrupt_truncated_and_foreign(tmp_path):
    lay = _layout()
    h = lay.header(b"k" * 16, 123)
    assert len(h) == HEADER_BYTES and lay.check_header(h, lay.file_bytes) == (b"k" * 16, 123)
    bad = bytearray(h)
    bad[40] ^= 1
    with pytest.raises(BlockFileError) as e:
        lay.check_header(bytes(bad))
    assert e.value.kind == "corrupt"
    with pytest.raises(BlockFileError) as e:
        lay.check_header(h, lay.file_bytes - 1)
    assert e.value.kind == "truncated"
    with pytest.raises(BlockFileError) as e:
        lay.check_header(h[:20])
    assert e.value.kind == "truncated"
    for other in (_layout(fp=bytes(16)), _layout(heads=HEADS + 1), _layout(torch.bfloat16), _layout(rank=1, tp=2)):
        with pytest.raises(BlockFileError) as e:
            other.check_header(h)
        assert e.value.kind == "foreign"


def test_scan_keeps_whole_blocks_of_every_rank(tmp_path):
    lay = _layout(tp=2)
    x = torch.randn((2, *lay.shape))
    keys = [b"a" * 16, b"b" * 16]
    for rank in (0, 1):
        c = DiskKVConnector(str(tmp_path), lay.for_rank(rank))
        c.put(keys, x) if rank == 0 else c.put(keys[:1], x[:1])  # rank 1 lacks block b
        c.close()
    (tmp_path / ".x.tmp").write_bytes(b"half")
    os.utime(tmp_path / ".x.tmp", (0, 0))  # (stale; a fresh one may be another engine's write in progress)
    (tmp_path / ".y.tmp").write_bytes(b"writing")
    (tmp_path / "notes.txt").write_text("not a block")
    res = scan_directory(str(tmp_path), lay)
    assert [k for _, k in res.blocks] == [keys[0]] and res.incomplete == 1
    assert sorted(os.listdir(tmp_path)) == sorted([block_file_name(keys[0], 0), block_file_name(keys[0], 1),
                                                   ".y.tmp", "notes.txt"])
    # a tier one block large deletes the oldest beyond it at start
    t = KVOffloadTier(str(tmp_path), lay.file_bytes * 2 * 1.5 / (1 << 30), lay, KVCacheOps())
    assert t.capacity_blocks == 1 and len(t.index) == 1


def test_a_block_is_served_from_memory_until_its_file_is_written(tmp_path):
    import threading

    lay = _layout()
    conn = DiskKVConnector(str(tmp_path), lay)
    gate = threading.Event()
    write = conn._write
    conn._write = lambda key, block: (gate.wait(10), write(key, block))
    x = torch.randn((2, *lay.shape))
    keys = [b"p" * 16, b"q" * 16]
    conn.put(keys, x)
    assert os.listdir(tmp_path) == [] and conn._pending_bytes == 2 * lay.payload_bytes
    assert torch.equal(conn.read(keys), x.transpose(0, 1)) and conn.has(tuple(keys))
    gate.set()
    conn.close()
    assert len(os.listdir(tmp_path)) == 2 and not conn._pending


def test_offload_ops_record_pickle_and_read_back():
    import pickle

    ops = KVCacheOps()
    ops.copy(1, 2, 3)
    ops.offload([4, 5], [b"a" * 16, b"b" * 16], [b"c" * 16])
    ops.offload([], [], [b"d" * 16])  # deletions alone are a batch too
    ops.swap_in([0], [4])  # (after the offload read block 4: a new batch, in order)
    with pytest.raises(ValueError, match="2 device blocks for 1 keys"):
        ops.offload([1, 2], [b"x" * 16])
    got = pickle.loads(pickle.dumps(ops.take()))
    assert [b.kind for b in got.batches] == ["copy", OFFLOAD, OFFLOAD, "swap_in"]
    assert got.batches[1].source == ((b"a" * 16, b"b" * 16), (b"c" * 16,))
    assert got.moves()[1:3] == [(OFFLOAD, 4, 0), (OFFLOAD, 5, 1)]


# ---------------------------------------------------------------- the directory going away


def _local_tier(tmp_path, directory):
    """A KV manager with local pools (6 blocks) over a disk tier in ``directory``, its connector
    attached to the manager's mover."""
    g = torch.Generator().manual_seed(0)
    pools = [tuple(torch.randn((6, BS, HEADS, ROW), generator=g) for _ in range(2)) for _ in range(LAYERS)]
    tier = KVOffloadTier(str(directory), 1, _layout(), KVCacheOps(), scan=False)
    kv = KVCacheManager(6, BS, True, pools, offload=tier)
    kv._mover.disk = DiskKVConnector(str(directory), _layout())
    return kv, tier, kv._mover.disk


def _sync(tier, conn) -> dict:
    """Wait for the connector's writes, hand its report to the tier; the tier's stats."""
    conn.flush()
    tier.on_reports([conn.take_report()])
    return tier.stats()


def _prompt_of(start: int) -> list[int]:
    return list(range(start, start + 4 * BS + 1))  # 4 full blocks + 1 token


def _disk_records(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_deleted_directory_is_recreated_and_only_real_writes_count(tmp_path, caplog):
    import shutil

    d = tmp_path / "tier"
    d.mkdir()
    kv, tier, conn = _local_tier(tmp_path, d)
    a, b, c = _prompt_of(10), _prompt_of(100), _prompt_of(200)
    _run(kv, _req("a", a))
    _run(kv, _req("b", b))  # evicts 3 of a's blocks: written
    s = _sync(tier, conn)
    assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"], s["kv_offload_blocks"]) == (3, 0, 3)
    shutil.rmtree(d)
    with caplog.at_level(logging.WARNING):
        _run(kv, _req("c", c))  # evicts a's last block and b's 3: the writer recreates the directory, writes them
        s = _sync(tier, conn)
    assert d.is_dir() and conn.num_recreated == 1
    assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"], s["kv_offload_pending_writes"]) == (7, 0, 0)
    # a's 3 blocks went with the directory: only the 4 written since are indexed, each with its file
    assert s["kv_offload_blocks"] == 4 and sorted(os.listdir(d)) == sorted(block_file_name(k, 0) for k in tier.index)
    records = _disk_records(caplog)
    assert len(records) == 1 and "was gone" in records[0].getMessage() and "recreated" in records[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)
    # a's block 0 (written since) is read back; its blocks 1-3 are misses, not failed reads
    r = _req("a2", a)
    kv.admit(r, 1000)
    s = tier.stats()
    assert r.num_cached_tokens == BS and (s["kv_offload_read_blocks"], s["kv_offload_read_failed"]) == (1, 0)
    kv.free(r)
    conn.close()
    assert not conn._thread.is_alive()


def test_a_directory_replaced_by_a_file_turns_the_writes_off(tmp_path, caplog):
    import shutil

    d = tmp_path / "tier"
    d.mkdir()
    kv, tier, conn = _local_tier(tmp_path, d)
    a, b, c, e = _prompt_of(10), _prompt_of(100), _prompt_of(200), _prompt_of(300)
    _run(kv, _req("a", a))
    _run(kv, _req("b", b))
    assert _sync(tier, conn)["kv_offload_written_blocks"] == 3
    shutil.rmtree(d)
    d.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        _run(kv, _req("c", c))  # 4 writes: each fails, the directory cannot be recreated
        s = _sync(tier, conn)
        assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"]) == (3, 4)
        assert s["kv_offload_writes_disabled"] == 1 and s["kv_offload_blocks"] == 0 and tier.disabled
        kv.ops.take()
        _run(kv, _req("e", e))  # evicts c's blocks: no write is recorded any more
        assert not [x for x in kv.ops.take().batches if x.kind == OFFLOAD]
        r = _req("a2", a)  # a's blocks were on disk: a miss, computed again, no failed read
        kv.admit(r, 1000)
        assert r.num_cached_tokens == 0 and not [x for x in kv.ops.batches if x.kind == LOAD]
        kv.free(r)
        s = _sync(tier, conn)
        conn.close()
    assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"], s["kv_offload_read_failed"]) == (3, 4, 0)
    records = _disk_records(caplog)
    assert len(records) == 1 and "cannot be recreated" in records[0].getMessage()
    assert "FileExistsError" in records[0].getMessage() and not any(r.exc_info for r in caplog.records)
    assert d.read_text() == "not a directory" and not conn._thread.is_alive() and not conn._pending


def test_an_unrecreatable_directory_read_only_parent(tmp_path, caplog):
    """The directory deleted and its parent read-only: recreating it is refused (PermissionError)."""
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    import shutil

    parent = tmp_path / "p"
    d = parent / "tier"
    d.mkdir(parents=True)
    kv, tier, conn = _local_tier(tmp_path, d)
    _run(kv, _req("a", _prompt_of(10)))
    shutil.rmtree(d)
    parent.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING):
            _run(kv, _req("b", _prompt_of(100)))
            s = _sync(tier, conn)
            conn.close()
    finally:
        parent.chmod(0o700)
    assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"], s["kv_offload_writes_disabled"]) == (0, 3, 1)
    records = _disk_records(caplog)
    assert len(records) == 1 and "PermissionError" in records[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


def test_write_failures_are_logged_once_then_counted(tmp_path, caplog):
    """Writes that fail with the directory in place (a full disk): each counted, the first logged
    with its path and error, then at most one line per FAILURE_LOG_INTERVAL_S."""
    from kvserve.core import kv_offload

    tier = KVOffloadTier(str(tmp_path), 1, _layout(), KVCacheOps(), scan=False)
    now = [1000.0]
    tier.clock = lambda: now[0]
    keys = [bytes([i]) * 16 for i in range(200)]
    tier._write(list(range(200)), keys)
    cause = "OSError: [Errno 28] No space left on device: '/d/.x.tmp'"
    with caplog.at_level(logging.WARNING):
        tier.on_reports([{"events": [("failed", i, cause) for i in range(150)] + [("written", 150)]}])
        assert len(_disk_records(caplog)) == 1
        now[0] += kv_offload.FAILURE_LOG_INTERVAL_S
        tier.on_reports([{"events": [("failed", i, cause) for i in range(151, 200)]}])
    s = tier.stats()
    assert (s["kv_offload_written_blocks"], s["kv_offload_failed_writes"], s["kv_offload_pending_writes"]) == (1, 199, 0)
    assert list(tier.index) == [keys[150]]  # the failed blocks are not on disk
    records = _disk_records(caplog)
    assert len(records) == 2 and not any(r.exc_info for r in caplog.records)
    assert "No space left on device: '/d/.x.tmp'" in records[0].getMessage()
    assert "150 more block write(s)" in records[1].getMessage()  # (149 held back + the one after the interval)


def test_a_block_counts_as_written_once_every_rank_wrote_it(tmp_path):
    tier = KVOffloadTier(str(tmp_path), 1, _layout(tp=2), KVCacheOps(), scan=False)
    keys = [b"a" * 16, b"b" * 16, b"c" * 16]
    tier._write([0, 1, 2], keys)
    tier.ops.take()
    tier.on_reports([{"events": [("written", 0), ("written", 1), ("written", 2)]}, {"events": [("written", 0)]}])
    assert (tier.num_written_blocks, tier.num_failed_writes, tier.num_pending_writes) == (1, 0, 2)
    tier.on_reports([None, {"events": [("failed", 1, "OSError: x"), ("written", 2)]}])
    assert (tier.num_written_blocks, tier.num_failed_writes, tier.num_pending_writes) == (2, 1, 0)
    assert list(tier.index) == [keys[0], keys[2]]
    ops = tier.ops.take()  # rank 0's file of the failed block is deleted
    assert [(x.kind, x.source) for x in ops.batches] == [(OFFLOAD, ((), (keys[1],)))]
