"""The prefix cache's disk tier, the engine core's side: which blocks are on disk, their keys,
LRU order and byte budget (:class:`KVOffloadTier`).

With ``kv_offload_dir`` / ``kv_offload_gib`` (``--kv-offload-dir`` / ``--kv-offload-gib``) the
full blocks that the in-memory radix cache (:mod:`kvserve.core.radix_cache`) evicts are written
to disk, and a request whose prefix continues past what memory holds reads the next blocks back
at admission (LMCache's local-disk backend, llama.cpp's ``--slot-save-path``):

* **Keys.** A block's key is a hash chain: ``key_0 = H(seed, tokens of block 0)``, ``key_i =
  H(key_{i-1}, tokens of block i)`` with ``seed = H(model fingerprint, adapter, cache_salt)`` and
  ``H`` BLAKE2b-128, so a key stands for the model, the namespace and every token from the start
  up to the end of its block (the radix path): two requests share a file exactly where the radix
  tree would share a node. The model fingerprint (:func:`model_fingerprint`) covers the model
  file's identity, dtype, KV dtype, quantization, block size, layer/head shapes and the
  tensor-parallel size, so another model's (or the same model's at another dtype) files never
  match. The key of every block in the tree is kept (:attr:`KVOffloadTier.key_of`), set when the
  block enters the tree (:meth:`KVCacheManager.cache_computed`): an eviction costs no rehash.
* **Writes.** An evicted block whose key is not on disk yet is recorded as an ``offload`` op
  (:mod:`kvserve.core.kv_ops`): every worker copies its shard of the block out before anything
  else writes it, and its :class:`~kvserve.distributed.kv_transfer.disk_connector.DiskKVConnector`
  writes the file in a background thread. Over the budget, the least recently used blocks' files
  are deleted (an op too, after the writes). At shutdown the blocks still in memory are written
  as well (:meth:`KVOffloadTier.offload_cached`), so a restarted engine finds them.
* **Write outcomes.** The workers report what became of each write (the engine core asks them:
  :meth:`KVOffloadTier.on_reports`): a block counts as written (``kv_offload_written_blocks``)
  once every rank wrote its file, as failed (``kv_offload_failed_writes``) when one could not
  (a full disk, a removed directory), and then leaves the index. The first failure is logged
  with its cause (one line: the path and the ``OSError``), later ones at most once per
  :data:`FAILURE_LOG_INTERVAL_S` as a count. A directory deleted while the engine runs is
  recreated by the next write, and the blocks that were in it leave the index (one warning);
  one that cannot be recreated (the path is a file now, permission denied) turns the tier's
  writes off for good (one warning) and empties the index: the prefix cache goes on in memory,
  a prefix that was on disk is recomputed. Serving never fails because of the disk.
* **Reads.** At admission, after the in-memory match ends, the tier continues the chain over the
  request's next full blocks while their keys are on disk (:meth:`KVOffloadTier.lookup`); the
  KV manager loads them into fresh blocks at once (a ``load`` op of the ``"disk"`` connector)
  and inserts them into the radix tree as ordinary cached blocks. A read that fails (a missing,
  corrupt or truncated file) makes that request recompute after its in-memory hit, and its keys
  leave the index.
* **Restarts.** The index is rebuilt from the directory's file headers at start
  (:func:`~kvserve.distributed.kv_transfer.disk_connector.scan_directory`), oldest first.

Units: budgets in GiB and bytes, blocks of ``block_size`` tokens, one file per block and rank.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import numbers
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from kvserve.core.kv_ops import KVCacheOps
from kvserve.core.radix_cache import Namespace
from kvserve.distributed.kv_transfer.base import KVTransferHandle
from kvserve.distributed.kv_transfer.disk_connector import BlockFileLayout, block_file_name, scan_directory

logger = logging.getLogger(__name__)

GiB = 1 << 30
#: Seconds between two warnings about failed block writes (the first is logged at once).
FAILURE_LOG_INTERVAL_S = 60.0
#: The largest ``kv_offload_gib`` accepted (GiB).
MAX_OFFLOAD_GIB = 1 << 20
#: Bytes of a block key (BLAKE2b digest size).
KEY_BYTES = 16


def check_offload_options(directory, gib, name=lambda field: field) -> Optional[str]:
    """Validate ``kv_offload_dir`` and ``kv_offload_gib``; create the directory. Returns its
    absolute path, or None when no directory is given (the tier is off).

    Args:
        name: maps a field name to the name the error uses (``--kv-offload-dir`` for the CLI).

    Raises:
        ValueError: naming the option: ``kv_offload_gib`` not a number in (0, 1048576] GiB,
            given without a directory, or the directory cannot be created or written.
    """
    if directory is None:
        if gib is not None:
            raise ValueError(f"{name('kv_offload_gib')} needs {name('kv_offload_dir')} (the directory of the disk tier)")
        return None
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise ValueError(f"{name('kv_offload_dir')} must be a directory path, got {directory!r}")
    if gib is None:
        raise ValueError(f"{name('kv_offload_dir')} needs {name('kv_offload_gib')} (the disk tier's size in GiB, > 0)")
    if not isinstance(gib, numbers.Real) or isinstance(gib, bool) or not 0 < gib <= MAX_OFFLOAD_GIB:
        raise ValueError(f"{name('kv_offload_gib')} must be a number of GiB in (0, {MAX_OFFLOAD_GIB}], got {gib!r}")
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvserve-write-test-", suffix=".tmp"):
            pass
    except OSError as e:
        raise ValueError(f"{name('kv_offload_dir')}: cannot create or write the directory {str(path)!r} "
                         f"({type(e).__name__}: {e.strerror or e})") from e
    return str(path)


def _file_identity(path: Path) -> list:
    """A model file's identity: its name, size and a BLAKE2b of 17 sampled 64 KiB pieces (the
    start, the end and 15 between): ms for a GB file, and any re-quantization or other weights
    change it."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    piece = 1 << 16
    with open(path, "rb") as f:
        for i in range(17):
            f.seek(max(0, min(size - piece, (size - piece) * i // 16)))
            h.update(f.read(piece))
    return [path.name, size, h.hexdigest()]


def model_fingerprint(model_path, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int, num_layers: int,
                      num_kv_heads: int, head_dim: int, tp_size: int, quantization: Optional[str]) -> tuple[bytes, str]:
    """The fingerprint of the K/V a model computes: ``(16-byte BLAKE2b, the JSON it hashes)``.

    It covers the model file's identity (:func:`_file_identity` of the GGUF, or of a folder's
    ``config.json`` and weight files), the dtype, KV dtype, weight quantization, block size,
    layers, KV heads, head size and tensor-parallel size: every input that changes a block's
    bytes or shapes.
    """
    p = Path(model_path)
    files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.suffix in (".json", ".safetensors", ".gguf", ".bin")
                                           and x.name not in ("tokenizer.json", "tokenizer_config.json"))
    doc = json.dumps({"model": [_file_identity(f) for f in files], "dtype": str(dtype), "kv_dtype": str(kv_dtype),
                      "quantization": quantization, "block_size": block_size, "num_layers": num_layers,
                      "num_kv_heads": num_kv_heads, "head_dim": head_dim, "tp_size": tp_size}, sort_keys=True)
    return hashlib.blake2b(doc.encode(), digest_size=KEY_BYTES).digest(), doc


class KVOffloadTier:
    """The books of the disk tier (module docstring): the keys of the tree's blocks, the keys on
    disk in LRU order, the byte budget, and the counters. Records its writes and deletions in
    ``ops``; reads go through the KV manager's load (:meth:`handle`).

    Args:
        directory: the tier's directory (:func:`check_offload_options`).
        capacity_gib: most GiB of block files (all ranks).
        layout: rank 0's :class:`BlockFileLayout` (the fingerprint, shapes, ranks).
        ops: the KV manager's op recorder.
        scan: rebuild the index from ``directory`` now (beyond the budget, the oldest files are
            deleted at once).

    Raises:
        ValueError: naming ``kv_offload_gib``: the budget holds no block file.

    Attributes:
        key_of: tree block id → its key (set by the KV manager when the block enters the tree).
        index: keys on disk (or queued to be), least recently used first.
        disabled: None, or why the tier's writes are off (its directory could not be recreated).
        closed: the workers' writers are stopped (shutdown): :attr:`awaiting_reports` is False.
        clock: the clock of the failure warnings' rate limit (seconds; ``time.monotonic``).
    """

    clock = staticmethod(time.monotonic)

    def __init__(self, directory: str, capacity_gib: float, layout: BlockFileLayout, ops: Optional[KVCacheOps],
                 scan: bool = True) -> None:
        self.directory = directory
        self.layout = layout
        self.ops = ops
        self.block_file_bytes = layout.file_bytes * layout.tp_size
        self.capacity_blocks = int(capacity_gib * GiB) // self.block_file_bytes
        self.key_of: dict[int, bytes] = {}
        self.index: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: set[bytes] = set()
        self.disabled: Optional[str] = None
        self.closed = False  # the workers' writers are stopped (at shutdown): nothing more to report
        # writes recorded and not yet reported by every rank: seq -> [key, ranks reported, one failed,
        # lost (written before the directory went)]; seq numbers the recorded blocks 0, 1, ... as
        # every worker's connector numbers the blocks it is put (the ops reach each in order)
        self._inflight: dict[int, list] = {}
        self._inflight_keys: dict[bytes, int] = {}  # key -> its writes in flight
        self._next_seq = 0
        self._ask = False  # a read failed: a worker may have found the directory gone
        self._failure_logged_at: Optional[float] = None
        self._failures_unlogged = 0
        self.num_written_blocks = 0  # blocks every rank wrote
        self.num_failed_writes = 0  # blocks a rank could not write (not on disk)
        self.num_read_blocks = 0  # blocks loaded back
        self.num_hit_requests = 0  # admissions that loaded at least one block
        self.num_read_failed = 0  # loads that failed (the request recomputed)
        self.num_deleted_blocks = 0  # files deleted to stay in the budget (or after a failed read)
        self.num_scanned_blocks = 0
        if self.capacity_blocks < 1:
            raise ValueError(f"kv_offload_gib={capacity_gib} holds no KV block file of {self.block_file_bytes} bytes "
                             f"(all ranks); raise kv_offload_gib")
        if scan:
            res = scan_directory(directory, layout)
            for _, key in res.blocks:
                self.index[key] = None
            self.num_scanned_blocks = len(res.blocks)
            for key in self._enforce_budget(record=False):  # (a smaller budget than last time: the oldest go now)
                for rank in range(layout.tp_size):
                    try:
                        os.unlink(os.path.join(directory, block_file_name(key, rank)))
                    except FileNotFoundError:
                        pass

    # ------------------------------------------------------------------ keys
    def seed(self, namespace: Namespace) -> bytes:
        """The chain's start for a namespace: ``H(fingerprint, namespace without the model path)``
        (the fingerprint identifies the model; its path does not matter)."""
        rest = repr(tuple(kv for kv in namespace if kv[0] != "model")).encode()
        return hashlib.blake2b(self.layout.fingerprint + rest, digest_size=KEY_BYTES).digest()

    def chain(self, prev: bytes, token_ids: Sequence[int], start: int, num_blocks: int) -> list[bytes]:
        """Keys of blocks ``start .. start + num_blocks - 1`` of ``token_ids``, ``prev`` being the
        key of block ``start - 1`` (or the namespace's :meth:`seed`)."""
        bs = self.layout.block_size
        raw = np.asarray(token_ids[start * bs:(start + num_blocks) * bs], dtype=np.int64).tobytes()
        step = bs * 8
        out = []
        for i in range(num_blocks):
            prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step], digest_size=KEY_BYTES).digest()
            out.append(prev)
        return out

    def prev_key(self, namespace: Namespace, blocks: Sequence[int]) -> Optional[bytes]:
        """The key after which a request's next block chains: the key of the last of its cached
        ``blocks`` (tree blocks), or the namespace's seed when there are none; None when the
        last block's key is unknown."""
        return self.key_of.get(blocks[-1]) if blocks else self.seed(namespace)

    def note_cached(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Record the keys of blocks that entered the tree."""
        self.key_of.update(zip(blocks, keys))

    # ------------------------------------------------------------------ writes
    def on_evict(self, blocks: Sequence[int]) -> None:
        """The radix cache evicted ``blocks``: record the writing of those not on disk yet (an
        ``offload`` op; a block seen on disk already only becomes most recently used)."""
        keys, src = [], []
        for b in blocks:
            key = self.key_of.pop(b, None)
            if key is None:
                continue
            if key in self.index:
                self.index.move_to_end(key)
            elif key not in keys:
                keys.append(key)
                src.append(b)
        self._write(src, keys)

    def offload_cached(self, blocks_lru: Sequence[int]) -> int:
        """Record the writing of the tree's blocks (least recently used first) not on disk yet,
        the most recently used within the budget (at shutdown). Returns the blocks recorded (0
        when the writes are off)."""
        if self.disabled is not None:
            return 0
        todo = [(b, k) for b in blocks_lru if (k := self.key_of.get(b)) is not None and k not in self.index]
        todo = todo[-self.capacity_blocks:] if self.capacity_blocks else []
        self._write([b for b, _ in todo], [k for _, k in todo])
        return len(todo)

    def _write(self, src: list[int], keys: list[bytes]) -> None:
        if self.capacity_blocks < 1 or self.disabled is not None:
            return
        if len(keys) > self.capacity_blocks:
            src, keys = src[-self.capacity_blocks:], keys[-self.capacity_blocks:]
        for k in keys:
            self.index[k] = None
            self._inflight[self._next_seq] = [k, 0, False, False]
            self._inflight_keys[k] = self._inflight_keys.get(k, 0) + 1
            self._next_seq += 1
        drop = self._enforce_budget(record=False)
        if keys or drop:
            self.ops.offload(src, keys, drop)

    # ------------------------------------------------------------------ write outcomes
    @property
    def awaiting_reports(self) -> bool:
        """Whether the workers have outcomes to report (:meth:`on_reports`): writes in flight,
        or a read failed since the last report."""
        return not self.closed and (bool(self._inflight) or self._ask)

    @property
    def num_recorded_writes(self) -> int:
        """Blocks ever recorded for writing (written, failed or pending)."""
        return self._next_seq

    @property
    def num_pending_writes(self) -> int:
        """Blocks recorded for writing whose outcome is not reported yet."""
        return len(self._inflight)

    def on_reports(self, reports: Sequence[Optional[dict]]) -> None:
        """Take in the workers' reports (each rank's
        :meth:`~kvserve.distributed.kv_transfer.disk_connector.DiskKVConnector.take_report`; None
        from a rank without one): count the blocks written and failed, drop failed blocks from
        the index (with several ranks, the other ranks' files are deleted), forget the blocks of a
        directory that was gone, turn the writes off when it could not be recreated; logs (at
        most one line per kind here, write failures rate-limited)."""
        self._ask = False
        lost: Optional[int] = None  # blocks dropped because the directory was gone
        disabled: Optional[int] = None  # blocks on disk when the writes were turned off
        drop: list[bytes] = []
        for report in reports:
            for event in (report or {}).get("events", ()):
                kind = event[0]
                if kind in ("written", "failed"):
                    key = self._ack(event[1], kind == "written")
                    if key is not None and key in self.index:
                        del self.index[key]
                        drop.append(key)
                    if kind == "failed" and event[2] is not None:
                        self._log_write_failure(event[2])
                elif kind == "lost":
                    lost = (lost or 0) + self._forget_written()
                elif kind == "disabled" and self.disabled is None:
                    disabled = sum(k not in self._inflight_keys for k in self.index)  # (on disk until now)
                    self.disabled = event[1]
        if disabled is not None:
            self.index.clear()
            self._pinned.clear()
            logger.warning("KV disk tier: the directory %s is gone and cannot be recreated (%s); writes to the disk "
                           "tier are off from now on, %d block(s) on it are lost and the prefix cache goes on in "
                           "memory", self.directory, self.disabled, disabled)
        elif lost is not None:
            logger.warning("KV disk tier: the directory %s was gone (deleted while the engine ran); recreated it. The "
                           "%d block(s) written there before are lost (their prefixes are recomputed)",
                           self.directory, lost)
        if drop and self.layout.tp_size > 1 and self.disabled is None:
            self.ops.offload([], [], drop)  # (the ranks that did write their shard)

    def _ack(self, seq: int, ok: bool) -> Optional[bytes]:
        """One rank's outcome of write ``seq``; once every rank's is in, counts the block and
        returns its key when it is to leave the index (a rank failed, or it was lost)."""
        entry = self._inflight.get(seq)
        if entry is None:
            return None
        entry[1] += 1
        entry[2] = entry[2] or not ok
        if entry[1] < self.layout.tp_size:
            return None
        del self._inflight[seq]
        key = entry[0]
        left = self._inflight_keys.pop(key) - 1
        if left:
            self._inflight_keys[key] = left
        if entry[2]:
            self.num_failed_writes += 1
        else:
            self.num_written_blocks += 1
        return key if (entry[2] or entry[3]) and not left else None

    def _forget_written(self) -> int:
        """The directory was gone: the keys written to it leave the index (writes in flight that
        a rank had written already leave it when done). Returns the keys dropped."""
        written = [k for k in self.index if k not in self._inflight_keys]
        for k in written:
            del self.index[k]
        for entry in self._inflight.values():
            if entry[1]:
                entry[3] = True
        return len(written)

    def _log_write_failure(self, cause: str) -> None:
        """Warn of a failed block write: the first at once, then at most one line (a count)
        per :data:`FAILURE_LOG_INTERVAL_S`."""
        now = self.clock()
        if self._failure_logged_at is None:
            logger.warning("KV disk tier: writing a block to %s failed (%s); that block is not on disk. Further "
                           "failures are counted (kv_offload_failed_writes) and logged at most every %.0f s",
                           self.directory, cause, FAILURE_LOG_INTERVAL_S)
        elif now - self._failure_logged_at >= FAILURE_LOG_INTERVAL_S:
            logger.warning("KV disk tier: %d more block write(s) to %s failed in the last %.0f s (the last: %s)",
                           self._failures_unlogged + 1, self.directory, now - self._failure_logged_at, cause)
        else:
            self._failures_unlogged += 1
            return
        self._failure_logged_at = now
        self._failures_unlogged = 0

    def _enforce_budget(self, record: bool = True) -> list[bytes]:
        """Drop the least recently used keys (not pinned) beyond the budget; returns them (and
        records their deletion when ``record``)."""
        drop: list[bytes] = []
        over = len(self.index) - self.capacity_blocks
        if over <= 0:
            return drop
        for key in list(itertools.islice(self.index, over + len(self._pinned))):  # (the oldest only: O(over))
            if len(drop) == over:
                break
            if key not in self._pinned:
                del self.index[key]
                drop.append(key)
        self.num_deleted_blocks += len(drop)
        if record and drop:
            self.ops.offload([], [], drop)
        return drop

    # ------------------------------------------------------------------ reads
    def lookup(self, namespace: Namespace, token_ids: Sequence[int], cached_blocks: Sequence[int],
               max_blocks: int) -> list[bytes]:
        """Keys on disk of the blocks right after ``cached_blocks`` (the in-memory match, tree
        blocks) of ``token_ids``, as many as follow one another, at most ``max_blocks``; they
        become most recently used and are pinned (not deleted) until :meth:`unpin`."""
        prev = self.prev_key(namespace, cached_blocks)
        if prev is None or max_blocks <= 0 or not self.index:
            return []
        start = len(cached_blocks)
        bs = self.layout.block_size
        out: list[bytes] = []
        while len(out) < max_blocks:
            n = min(max_blocks - len(out), 8 if not out else 32)  # (hash a few ahead at a time)
            keys = self.chain(prev, token_ids, start + len(out), min(n, len(token_ids) // bs - start - len(out)))
            if not keys:
                break
            for k in keys:
                if k not in self.index:
                    break
                out.append(k)
            else:
                prev = keys[-1]
                continue
            break
        for k in out:
            self.index.move_to_end(k)
        self._pinned.update(out)
        return out

    def unpin(self) -> None:
        self._pinned.clear()

    def handle(self, keys: Sequence[bytes]) -> KVTransferHandle:
        """The load handle of the blocks ``keys`` (:meth:`KVCacheOps.load`'s ``source``): the
        ``"disk"`` connector, payload block ``i`` is ``keys[i]``."""
        lay = self.layout
        return KVTransferHandle("disk", tuple(keys), len(keys) * lay.block_size, "", lay.block_size,
                                (lay.num_layers, lay.num_kv_heads, lay.row, str(lay.dtype), lay.tp_size),
                                len(keys) * lay.payload_bytes * lay.tp_size)

    def loaded(self, num_blocks: int) -> None:
        """Count a successful read of ``num_blocks`` blocks."""
        self.num_read_blocks += num_blocks
        self.num_hit_requests += 1

    def failed(self, keys: Sequence[bytes]) -> None:
        """A read of ``keys`` failed: they leave the index and their files are deleted (a file a
        worker found corrupt is deleted already; the other ranks' go too). The workers are asked
        for a report next (a reader that found the directory gone reports it)."""
        self.num_read_failed += 1
        self._ask = True
        gone = [k for k in keys if k in self.index]
        for k in gone:
            del self.index[k]
        self._pinned.difference_update(keys)
        if gone and self.disabled is None:
            self.ops.offload([], [], gone)

    # ------------------------------------------------------------------ metrics
    @property
    def num_bytes(self) -> int:
        """Bytes of the block files the index holds (all ranks)."""
        return len(self.index) * self.block_file_bytes

    def stats(self) -> dict:
        """Disk-tier counters: blocks written (every rank's file written, as reported), blocks
        whose write failed, blocks whose outcome is not reported yet, blocks read back, admissions
        that read from disk, failed reads, files deleted for the budget, blocks found at start,
        and the tier's blocks, bytes and capacity now (and 1 when its writes are off)."""
        return {
            "kv_offload_written_blocks": self.num_written_blocks,
            "kv_offload_failed_writes": self.num_failed_writes,
            "kv_offload_pending_writes": self.num_pending_writes,
            "kv_offload_writes_disabled": int(self.disabled is not None),
            "kv_offload_read_blocks": self.num_read_blocks,
            "kv_offload_hits": self.num_hit_requests,
            "kv_offload_read_failed": self.num_read_failed,
            "kv_offload_deleted_blocks": self.num_deleted_blocks,
            "kv_offload_scanned_blocks": self.num_scanned_blocks,
            "kv_offload_blocks": len(self.index),
            "kv_offload_bytes": self.num_bytes,
            "kv_offload_capacity_blocks": self.capacity_blocks,
        }
