"""The ``"disk"`` KV connector: the prefix cache's disk tier, one file per KV block and rank.

Full blocks evicted from the in-memory prefix cache are written to a directory and read back
when a later request's prefix continues past what memory still holds (LMCache's local-disk
backend; llama.cpp's ``--slot-save-path``). The engine core keeps the books (which blocks are on
disk, their LRU order and the byte budget: :class:`kvserve.core.kv_offload.KVOffloadTier`);
each worker owns a :class:`DiskKVConnector` for its tensor-parallel rank that writes and reads
its own shard of each block (``<key>.r<rank>.kvb``), and that the block ops of
:mod:`kvserve.core.kv_ops` drive: an ``offload`` batch copies device blocks out and queues their
files to a background writer thread (the step loop only pays the copy), a ``load`` batch whose
handle names this connector reads files back synchronously at admission.

File format (little-endian; :data:`HEADER`): a fixed header, then the payload. The header holds
a magic, the format version, the **model fingerprint** (16 bytes: the model file's identity,
dtype, KV dtype, block size, layer/head shapes, tensor-parallel size:
:func:`kvserve.core.kv_offload.model_fingerprint`), the block's **key** (16 bytes: the hash
chain over fingerprint, namespace and every token up to this block's end), the rank and the
shapes, the payload's length and CRC-32, and the CRC-32 of the header itself. The payload is the
block's K/V in the pools' row format, ``[2 · num_layers, block_size, num_kv_heads, row]`` (layer
``l``'s K at ``2l``, V at ``2l + 1``) of the pools' dtype, raw bytes. For the 2-/4-bit caches
(dtype ``uint4`` / ``uint2``, :mod:`kvserve.worker.kv_quant_lowbit`) each of the ``2 · num_layers``
parts is instead the block's packed codes and float16 scales and zeros as the pool holds them,
uint8 ``[num_kv_heads, block_bytes]`` (K and V parts differ in size: :meth:`BlockFileLayout.part_shapes`);
only full (quantized) blocks enter the prefix cache, so no residual rows are ever written. Files
are written to a temporary name and renamed, so a crash leaves no half file under a real name.

Refused files (never loaded): a bad magic, version or header CRC (corrupt: deleted), another
fingerprint or other shapes (foreign: another model's, or this model at another dtype or block
size, or this model with another ``kv_cache_dtype``: an int4 file is never read into an int2 or
bfloat16 pool; skipped, never deleted, so engines of several models can share a directory), a size that
is not header + payload (truncated: deleted), a payload whose CRC-32 differs (flipped bytes:
deleted, found when the block is read). Each is logged with a warning.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch

from kvserve.distributed.kv_transfer.base import KVConnector, KVPayload, KVTransferError

logger = logging.getLogger(__name__)

MAGIC = b"KVSBLK\x00\x01"
VERSION = 1
#: magic, version, header length, fingerprint, key, rank, tp size, layers, block size, KV heads,
#: row, dtype name, payload length, payload CRC-32; then the CRC-32 of those bytes (:data:`HEADER_CRC`).
HEADER = struct.Struct("<8sII16s16sIIIIII16sQI")
HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = HEADER.size + HEADER_CRC.size
SUFFIX = ".kvb"
#: Age (seconds) after which a start-up scan deletes a temporary file (a write cut short).
STALE_TMP_S = 600.0
#: Bytes of queued (not yet written) blocks above which :meth:`DiskKVConnector.put` waits for the writer.
MAX_PENDING_BYTES = 256 << 20


class BlockFileError(ValueError):
    """A block file that cannot be used. ``kind`` is ``"corrupt"`` (bad magic, version, header or
    payload CRC), ``"truncated"`` (size is not header + payload), or ``"foreign"`` (another model
    fingerprint, rank or shapes)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class BlockFileLayout:
    """What a block file of one rank must say about its model and shapes.

    Attributes:
        fingerprint: the model fingerprint (16 bytes, :func:`kvserve.core.kv_offload.model_fingerprint`).
        rank, tp_size: the tensor-parallel rank whose shard the file holds, and the rank count.
        num_layers, block_size, num_kv_heads, row: the payload's shape ``[2 · num_layers,
            block_size, num_kv_heads, row]`` (``num_kv_heads`` this rank's; ``row`` is
            ``head_dim``, or ``head_dim + 4`` for 8-bit pools); for 2-/4-bit pools ``row`` is
            ``head_dim`` and the parts are packed blocks (:meth:`part_shapes`).
        dtype: the pools' dtype (``torch.uint4`` / ``torch.uint2``: the 2-/4-bit formats' markers).
    """

    fingerprint: bytes
    rank: int
    tp_size: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    row: int
    dtype: torch.dtype

    @property
    def lowbit(self) -> bool:
        """The pools are 2-/4-bit ones (:mod:`kvserve.worker.kv_quant_lowbit`): packed parts."""
        return self.dtype in (torch.uint4, torch.uint2)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The payload ``[2 · num_layers, block_size, num_kv_heads, row]`` of a whole-row layout.

        Raises:
            ValueError: a 2-/4-bit layout, whose K and V parts differ in size (:meth:`part_shapes`).
        """
        if self.lowbit:
            raise ValueError(f"a {self.dtype_name.decode()} block file has K and V parts of different shapes: "
                             f"use part_shapes")
        return (2 * self.num_layers, self.block_size, self.num_kv_heads, self.row)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the payload's parts: uint8 for 2-/4-bit pools, else the pools' dtype."""
        return torch.uint8 if self.lowbit else self.dtype

    def part_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one block's K part and V part (each layer has one of each, K first): ``(block_size,
        num_kv_heads, row)`` both, or for 2-/4-bit pools the packed blocks ``(num_kv_heads,
        block_bytes)`` uint8 (:func:`kvserve.worker.kv_quant_lowbit.block_bytes`, K and V)."""
        if self.lowbit:
            from kvserve.worker.kv_quant_lowbit import bits_of, block_bytes

            bits = bits_of(self.dtype)
            return tuple((self.num_kv_heads, block_bytes(self.block_size, self.row, bits, is_key))
                         for is_key in (True, False))
        one = (self.block_size, self.num_kv_heads, self.row)
        return one, one

    def part_bytes(self) -> list[int]:
        """Bytes of each of the ``2 · num_layers`` parts of one block, in file order."""
        k, v = (math.prod(sh) * self.storage_dtype.itemsize for sh in self.part_shapes())
        return [k, v] * self.num_layers

    @property
    def payload_bytes(self) -> int:
        return sum(self.part_bytes())

    @property
    def file_bytes(self) -> int:
        """Size of one block file: header + payload."""
        return HEADER_BYTES + self.payload_bytes

    @property
    def dtype_name(self) -> bytes:
        return str(self.dtype).removeprefix("torch.").encode()[:16]

    def for_rank(self, rank: int) -> "BlockFileLayout":
        return BlockFileLayout(self.fingerprint, rank, self.tp_size, self.num_layers, self.block_size,
                               self.num_kv_heads, self.row, self.dtype)

    def header(self, key: bytes, payload_crc: int) -> bytes:
        """The header of the file of block ``key`` (16 bytes) whose payload has CRC-32 ``payload_crc``."""
        h = HEADER.pack(MAGIC, VERSION, HEADER_BYTES, self.fingerprint, key, self.rank, self.tp_size,
                        self.num_layers, self.block_size, self.num_kv_heads, self.row, self.dtype_name,
                        self.payload_bytes, payload_crc)
        return h + HEADER_CRC.pack(zlib.crc32(h))

    def check_header(self, raw: bytes, file_size: Optional[int] = None) -> tuple[bytes, int]:
        """Parse and check a header; returns ``(key, payload_crc)``.

        Args:
            raw: the file's first :data:`HEADER_BYTES` bytes (fewer: truncated).
            file_size: the file's size, checked against header + payload when given.

        Raises:
            BlockFileError: corrupt, foreign or truncated (its ``kind``), naming what differs.
        """
        if len(raw) < HEADER_BYTES:
            raise BlockFileError("truncated", f"{len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
        h, (crc,) = raw[:HEADER.size], HEADER_CRC.unpack_from(raw, HEADER.size)
        magic, version, hlen, fp, key, rank, tp, layers, bs, heads, row, dt, plen, pcrc = HEADER.unpack(h)
        if magic != MAGIC or version != VERSION or hlen != HEADER_BYTES or zlib.crc32(h) != crc:
            raise BlockFileError("corrupt", "bad magic, version or header checksum")
        if fp != self.fingerprint:
            raise BlockFileError("foreign", f"model fingerprint {fp.hex()} is not this engine's {self.fingerprint.hex()}")
        got = (rank, tp, layers, bs, heads, row, dt.rstrip(b"\0"), plen)
        want = (self.rank, self.tp_size, self.num_layers, self.block_size, self.num_kv_heads, self.row,
                self.dtype_name, self.payload_bytes)
        if got != want:
            raise BlockFileError("foreign", f"(rank, tp, layers, block_size, kv_heads, row, dtype, bytes) = {got}, "
                                            f"expected {want}")
        if file_size is not None and file_size != HEADER_BYTES + plen:
            raise BlockFileError("truncated", f"{file_size} bytes, expected {HEADER_BYTES + plen}")
        return key, pcrc


def block_file_name(key: bytes, rank: int) -> str:
    """``<32 hex digits of key>.r<rank>.kvb``."""
    return f"{key.hex()}.r{rank}{SUFFIX}"


def parse_file_name(name: str) -> Optional[tuple[bytes, int]]:
    """``(key, rank)`` of a block file name (:func:`block_file_name`), None for other names."""
    if not name.endswith(SUFFIX):
        return None
    stem, _, r = name[: -len(SUFFIX)].rpartition(".r")
    if len(stem) != 32 or not r.isdigit():
        return None
    try:
        return bytes.fromhex(stem), int(r)
    except ValueError:
        return None


@dataclass
class ScanResult:
    """What :func:`scan_directory` found.

    Attributes:
        blocks: ``(mtime_ns, key)`` of every block whose files of all ranks are valid, oldest first.
        corrupt, truncated, foreign, incomplete: files refused (the first two deleted), and
            blocks missing a rank's file (their other files deleted).
    """

    blocks: list[tuple[int, bytes]]
    corrupt: int = 0
    truncated: int = 0
    foreign: int = 0
    incomplete: int = 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def scan_directory(directory: str, layout: BlockFileLayout) -> ScanResult:
    """Rebuild the disk tier's index from ``directory``: read every block file's header (not its
    payload, whose CRC is checked when it is read) and keep the blocks whose files of every rank
    ``0 .. layout.tp_size - 1`` are this model's (``layout``, any rank) and whole.

    Corrupt and truncated files are deleted, foreign ones skipped, each with a warning (one line
    per kind, with the count and the first file); temporary files older than :data:`STALE_TMP_S`
    (writes cut short) are deleted.
    """
    found: dict[bytes, dict[int, int]] = {}
    res = ScanResult([])
    first: dict[str, str] = {}
    with os.scandir(directory) as it:
        entries = [e for e in it if e.is_file(follow_symlinks=False)]
    for e in entries:
        if e.name.startswith(".") and e.name.endswith(".tmp"):
            try:  # a write cut short (not one in progress in another engine on this directory)
                if time.time() - e.stat().st_mtime > STALE_TMP_S:
                    _unlink(e.path)
            except OSError:
                pass
            continue
        parsed = parse_file_name(e.name)
        if parsed is None:
            continue
        key, rank = parsed
        try:
            st = e.stat()
            with open(e.path, "rb") as f:
                raw = f.read(HEADER_BYTES)
            if rank >= layout.tp_size:
                raise BlockFileError("foreign", f"rank {rank} of {layout.tp_size}")
            got, _ = layout.for_rank(rank).check_header(raw, st.st_size)
            if got != key:
                raise BlockFileError("corrupt", f"header key {got.hex()} differs from the file name")
        except BlockFileError as err:
            setattr(res, err.kind, getattr(res, err.kind) + 1)
            first.setdefault(err.kind, f"{e.name}: {err}")
            if err.kind != "foreign":
                _unlink(e.path)
            continue
        except OSError:
            continue
        found.setdefault(key, {})[rank] = st.st_mtime_ns
    for kind, what in first.items():
        verb = "skipped" if kind == "foreign" else "deleted"
        logger.warning("KV disk tier %s: %d %s block file(s) %s (first: %s)", directory, getattr(res, kind), kind,
                       verb, what)
    for key, ranks in found.items():
        if len(ranks) == layout.tp_size:
            res.blocks.append((max(ranks.values()), key))
        else:
            res.incomplete += 1
            for r in ranks:
                _unlink(os.path.join(directory, block_file_name(key, r)))
    res.blocks.sort()
    return res


class _Pending:
    """A block queued for writing: block ``index`` of the parts ``arrays`` (uint8 views of the
    ``2 · num_layers`` tensors ``[n, block_size, num_kv_heads, row]`` a put was given); ``seq``
    is its number among the blocks ever put to this connector (0, 1, ...)."""

    __slots__ = ("arrays", "index", "seq")

    def __init__(self, arrays: list, index: int, seq: int) -> None:
        self.arrays = arrays
        self.index = index
        self.seq = seq

    def pieces(self) -> list:
        """The block's payload, in file order: one contiguous uint8 array per layer and K/V."""
        return [a[self.index] for a in self.arrays]


class DiskKVConnector(KVConnector):
    """One rank's side of the disk tier: writes its shard of offloaded blocks (in a background
    thread) and reads them back (:meth:`fetch`).

    The engine core decides what is written, read and deleted (:class:`~kvserve.core.kv_offload.KVOffloadTier`);
    this class does the file work. A block queued for writing is served from memory until its
    file is written, so a read right after an eviction never waits for the disk.

    What became of the writes goes back to the engine core (:meth:`take_report`, which logs it):
    the connector itself logs no expected ``OSError``. Each block put is numbered (its ``seq``: 0,
    1, ... in the order of the puts, the order in which the core recorded them) and reported
    written or failed, with the failure's cause. When the directory is gone (deleted while the
    engine runs) the writer recreates it (``os.makedirs``) and goes on, reporting ``"lost"``
    (the blocks written before are gone); when it cannot be recreated (the path is now a file,
    permission denied) the tier's writes are off for good: ``"disabled"``, every later write
    fails at once and deletions are skipped.

    Args:
        directory: where the block files are (must exist and be writable).
        layout: this rank's :class:`BlockFileLayout`.
        max_pending_bytes: queued bytes above which :meth:`put` waits for the writer (back-pressure).

    Counters: ``num_written_blocks``, ``num_write_errors`` (failed writes and deletions),
    ``num_loaded_blocks`` / ``num_loaded_bytes`` (blocks read back), ``num_failed`` (reads refused),
    ``num_deleted``, ``num_recreated`` (times the directory was recreated). ``disabled``: None, or
    why the writes are off.
    """

    name = "disk"

    def __init__(self, directory: str, layout: BlockFileLayout, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        super().__init__()
        self.directory = directory
        self.layout = layout
        self.max_pending_bytes = max_pending_bytes
        self.num_written_blocks = 0
        self.num_write_errors = 0
        self.num_deleted = 0
        self.num_recreated = 0
        self.disabled: Optional[str] = None
        self._num_put = 0  # blocks ever put (the next one's seq)
        self._events: list[tuple] = []  # what take_report hands over, in order
        self._dir_lock = threading.Lock()  # (the writer and a reader may both find the directory gone)
        self._pending: dict[bytes, _Pending] = {}  # key -> block not yet written
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kvserve-disk-writer-r{layout.rank}", daemon=True)
        self._thread.start()
        self._closed = False

    def path(self, key: bytes) -> str:
        return os.path.join(self.directory, block_file_name(key, self.layout.rank))

    # ------------------------------------------------------------------ writing
    def put(self, keys: Sequence[bytes], blocks) -> None:
        """Queue blocks for writing. ``blocks`` is either one tensor ``[len(keys), 2 · num_layers,
        block_size, num_kv_heads, row]`` (block ``i`` becomes the file of ``keys[i]``) or its
        ``2 · num_layers`` parts, each ``[len(keys), block_size, num_kv_heads, row]`` (layer ``l``'s K
        at ``2l``, V at ``2l + 1``: what a worker's pools give with one gather each, no further copy);
        the layout's dtype, on the CPU. Returns at once unless more than ``max_pending_bytes`` are
        queued (then waits for the writer). The tensors must not change until written.

        For a 2-/4-bit layout only the parts form is accepted: layer ``l``'s K part ``[len(keys),
        num_kv_heads, block_bytes_K]`` and V part ``[len(keys), num_kv_heads, block_bytes_V]`` uint8
        (:meth:`BlockFileLayout.part_shapes`).

        Raises:
            ValueError: shapes that do not match ``keys`` and the layout.
        """
        lay = self.layout
        parts = list(blocks.unbind(1)) if isinstance(blocks, torch.Tensor) else list(blocks)
        want = [(len(keys), *sh) for sh in lay.part_shapes()] * lay.num_layers
        if len(parts) != len(want) or any(tuple(p.shape) != w for p, w in zip(parts, want)):
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else [tuple(p.shape) for p in parts[:2]]
            raise ValueError(f"put: {len(keys)} keys for blocks of shape {got}, expected {len(want)} parts "
                             f"{want[0]} (K), {want[1]} (V)")
        arrays = [p.view(torch.uint8).numpy() for p in parts]  # (the writer slices these: no tensor per block)
        nbytes = lay.payload_bytes
        with self._cond:
            # (one object per block: dropped by identity; numbered in the order of the puts)
            items = [_Pending(arrays, i, self._num_put + i) for i in range(len(keys))]
            self._num_put += len(keys)
            while self._pending_bytes > self.max_pending_bytes and self._thread.is_alive():
                self._cond.wait(1.0)
            for key, item in zip(keys, items):
                if key not in self._pending:
                    self._pending_bytes += nbytes
                self._pending[key] = item
        for key, item in zip(keys, items):
            self._queue.put(("write", key, item))

    def delete(self, keys: Iterable[bytes]) -> None:
        """Queue the deletion of blocks' files (after the writes queued before)."""
        for key in keys:
            self._queue.put(("delete", key, None))

    def flush(self) -> None:
        """Wait until every queued write and deletion is done."""
        self._queue.join()

    def close(self) -> None:
        """Flush and stop the writer thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def take_report(self) -> dict:
        """What happened since the last call, in order (and forget it): ``{"events": [...]}``, each
        event one of ``("written", seq)``, ``("failed", seq, cause)`` (the block numbered ``seq``
        among the puts: :class:`DiskKVConnector`; ``cause`` names the path and the ``OSError``, or
        is None when the writes are off), ``("lost", cause)`` (the directory was gone and has been
        recreated: the files written before are gone) and ``("disabled", cause)`` (it could not be
        recreated: the writes are off from now on). A dict, so that an executor hands it back
        from another process as it is."""
        with self._cond:
            events, self._events = self._events, []
        return {"events": events}

    def _event(self, *event) -> None:
        with self._cond:
            self._events.append(event)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, key, block = item
                if op == "write":
                    self._write_reported(key, block)
                elif self.disabled is None:
                    self._delete(key)
            except Exception:  # noqa: BLE001 - a bug: the writer goes on
                self.num_write_errors += 1
                logger.warning("KV disk tier: %s of block %s failed", item[0], item[1].hex(), exc_info=True)
            finally:
                if item is not None and item[0] == "write":
                    with self._cond:
                        if self._pending.get(item[1]) is item[2]:
                            del self._pending[item[1]]
                            self._pending_bytes -= self.layout.payload_bytes
                        self._cond.notify_all()
                self._queue.task_done()

    def _write_reported(self, key: bytes, block: "_Pending") -> None:
        """Write a block's file and report how it went: never raises. A directory found gone is
        recreated and the write tried once more (:meth:`_directory_gone`)."""
        if self.disabled is not None:
            self._event("failed", block.seq, None)
            return
        try:
            try:
                self._write(key, block)
            except (FileNotFoundError, NotADirectoryError):
                if not self._directory_gone():
                    raise
                self._write(key, block)
        except OSError as e:  # a full disk, a removed or unwritable directory: that block is not written
            self.num_write_errors += 1
            self._event("failed", block.seq, None if self.disabled is not None else f"{type(e).__name__}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a bug: reported, with its traceback here
            self.num_write_errors += 1
            logger.warning("KV disk tier: writing block %s failed", key.hex(), exc_info=True)
            self._event("failed", block.seq, f"{type(e).__name__}: {e}")
            return
        self._event("written", block.seq)

    def _directory_gone(self) -> bool:
        """After an ``OSError`` that may mean the directory is gone: when it is, recreate it
        (``os.makedirs``; reports ``"lost"``) and return True; when it cannot be (the path is a
        file now, permission denied), turn the writes off (reports ``"disabled"``). False when the
        directory is there (the error was another) or the writes are off."""
        with self._dir_lock:
            if self.disabled is not None or os.path.isdir(self.directory):
                return False
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as e:
                self.disabled = f"{type(e).__name__}: {e}"
                self._event("disabled", self.disabled)
                return False
            self.num_recreated += 1
            self._event("lost", f"{self.directory!r} was gone; recreated")
            return True

    def _delete(self, key: bytes) -> None:
        path = self.path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # (the file stays; a start-up scan finds it)
            self.num_write_errors += 1
            logger.debug("KV disk tier: deleting %s failed (%s: %s)", path, type(e).__name__, e)
            return
        self.num_deleted += 1

    def _write(self, key: bytes, block: "_Pending") -> None:
        pieces = block.pieces()
        crc = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
        path = self.path(key)
        tmp = os.path.join(self.directory, f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(self.layout.header(key, crc))
                for piece in pieces:
                    f.write(piece)
            os.replace(tmp, path)
        except BaseException:
            try:  # (best effort: where the open failed there is no such file, or no directory)
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.num_written_blocks += 1

    # ------------------------------------------------------------------ reading
    def read(self, keys: Sequence[bytes]) -> torch.Tensor:
        """The blocks of ``keys`` (this rank's shard): ``[2 · num_layers, len(keys), block_size,
        num_kv_heads, row]`` in the layout's dtype, on the CPU (each layer's K and V contiguous, as
        the pools' scatter wants them; layer ``l``'s K at ``2l``). Queued blocks come from memory, the
        others from their files, each checked (header and payload CRC-32); a file read is marked
        recently used (its mtime, the LRU order a restart rebuilds).

        Raises:
            KVTransferError: a file is missing or refused (corrupt, truncated, foreign: deleted
                unless foreign, with a warning); nothing is returned then.
            ValueError: a 2-/4-bit layout (its parts differ in shape: :meth:`read_parts`).
        """
        lay = self.layout
        parts, rest = lay.shape[0], lay.shape[1:]
        out = torch.empty((parts, len(keys), *rest), dtype=lay.dtype)
        # [parts, n, bytes of one part] (numpy: these small copies stay on this thread)
        raw = out.view(parts, len(keys), -1).view(torch.uint8).numpy()
        self._read_into(keys, [raw[j] for j in range(parts)])
        return out

    def read_parts(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The blocks of ``keys`` as ``2 · num_layers`` tensors, layer ``l``'s K at ``2l`` and V at
        ``2l + 1``, each ``[len(keys), *part_shape]`` (:meth:`BlockFileLayout.part_shapes`) of the
        layout's storage dtype, on the CPU; any layout, 2-/4-bit ones included. Checks and errors
        as :meth:`read`."""
        lay = self.layout
        n = len(keys)
        out = [torch.empty((n, *sh), dtype=lay.storage_dtype) for _ in range(lay.num_layers)
               for sh in lay.part_shapes()]
        self._read_into(keys, [t.view(n, -1).view(torch.uint8).numpy() for t in out])
        return out

    def _read_into(self, keys: Sequence[bytes], dests: list) -> None:
        """Read the blocks of ``keys`` into ``dests``, one uint8 array ``[len(keys), part bytes]``
        per part (file order); the checks of :meth:`read`."""
        lay = self.layout
        sizes = lay.part_bytes()
        offsets = [0]
        for b in sizes:
            offsets.append(offsets[-1] + b)
        buf = np.empty(lay.payload_bytes, dtype=np.uint8)  # one file's payload, then spread out
        header = bytearray(HEADER_BYTES)
        for i, key in enumerate(keys):
            with self._cond:
                block = self._pending.get(key)
            if block is not None:
                for j, piece in enumerate(block.pieces()):
                    dests[j][i] = piece.reshape(-1)
                continue
            path = self.path(key)
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    n = f.readinto(header)
                    got, crc = lay.check_header(bytes(header[:n]), size)
                    if got != key:
                        raise BlockFileError("corrupt", f"header key {got.hex()} differs from the file name")
                    if f.readinto(memoryview(buf)) != lay.payload_bytes:
                        raise BlockFileError("truncated", "payload shorter than the header says")
                    if zlib.crc32(buf) != crc:
                        raise BlockFileError("corrupt", "payload checksum mismatch")
                for j, d in enumerate(dests):
                    d[i] = buf[offsets[j]:offsets[j + 1]]
            except BlockFileError as e:
                self.num_failed += 1
                logger.warning("KV disk tier: block file %s refused (%s: %s)%s", path, e.kind, e,
                               "" if e.kind == "foreign" else "; deleted")
                if e.kind != "foreign":
                    _unlink(path)
                raise KVTransferError(f"KV disk tier: block file {os.path.basename(path)} is {e.kind} ({e})") from e
            except OSError as e:
                self.num_failed += 1
                if isinstance(e, (FileNotFoundError, NotADirectoryError)):
                    self._directory_gone()  # (its blocks are gone: reported, the core forgets them)
                raise KVTransferError(f"KV disk tier: block file {os.path.basename(path)}: "
                                      f"{type(e).__name__}: {e}") from e
            try:
                os.utime(path)
            except OSError:
                pass
        self.num_loaded_blocks += len(keys)
        self.num_loaded_bytes += len(keys) * lay.payload_bytes

    # ------------------------------------------------------------------ KVConnector
    def fetch(self, key: Any, rank: int, blocks: Sequence[int]) -> KVPayload:
        """Blocks ``blocks`` (indices into ``key``, a tuple of block keys) of this rank's shard as
        a payload: per layer ``(K, V)``, each ``[len(blocks), block_size, num_kv_heads, row]``, or
        for a 2-/4-bit layout uint8 ``[len(blocks), num_kv_heads, block_bytes]`` (:meth:`read_parts`).

        Raises:
            KVTransferError: as :meth:`read`; or ``rank`` is not this connector's.
        """
        if rank != self.layout.rank:
            raise KVTransferError(f"KV disk tier: rank {rank} asked the connector of rank {self.layout.rank}")
        x = self.read_parts([key[b] for b in blocks])
        return [(x[2 * i], x[2 * i + 1]) for i in range(self.layout.num_layers)]

    def save(self, payloads: Sequence[KVPayload]) -> Any:
        raise TypeError("the disk tier's blocks are written by each worker (put), keyed by their token chain")

    def has(self, key: Any) -> bool:
        """Whether every block of ``key`` (a tuple of block keys) is queued or has a file here."""
        with self._cond:
            return all(k in self._pending or os.path.exists(self.path(k)) for k in key)

    def release(self, key: Any) -> None:
        """Delete the files of the blocks of ``key`` (a tuple of block keys)."""
        self.delete(key)
