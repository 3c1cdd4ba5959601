"""Block operations on the KV pools, recorded by the engine core and applied by the workers.

The engine core keeps the books of the paged KV cache (block tables, reference counts, the
prefix cache, the swap space's host blocks) but holds no KV tensor: the pools live on the
workers, and with tensor parallelism each worker holds a shard of every layer's pool (its KV
heads) and a shard of the host pool. Where the books say that K/V must move, the
:class:`~kvserve.core.kv_cache_manager.KVCacheManager` and the
:class:`~kvserve.core.kv_swap.KVSwapSpace` record the move in a :class:`KVCacheOps`; the engine
core hands the ops recorded since the last forward to the workers with the next step's
:class:`~kvserve.core.scheduler.SchedulerOutput` (``kv_ops``), and every worker applies them to
its own pools, in order, before that forward
(:class:`kvserve.worker.kv_block_mover.KVBlockMover`). The moves are:

* ``copy``: device block ``src`` → device block ``dst``, slots ``0 .. num_tokens - 1`` (a fork's
  or a beam clone's copy-on-write of a partial block, a partial prefix-cache hit);
* ``swap_out``: device block → host block (a preempted request's computed blocks);
* ``swap_in``: host block → device block (the same request resumed);
* ``load``: blocks saved by another engine (a KV connector's payload,
  :mod:`kvserve.distributed.kv_transfer`) → device blocks (prefill/decode disaggregation: a
  decode engine takes a request's prompt K/V from the prefill engine). The engine core applies
  a load at once, as it admits the request, with the ops recorded before it
  (:meth:`Worker.load_kv_blocks`), not with the step: a load can fail (the blocks are gone), and
  then only that request recomputes its prompt (:meth:`KVCacheManager.admit`). The disk tier's
  reads (:mod:`kvserve.core.kv_offload`) are loads of the ``"disk"`` connector;
* ``offload``: device blocks → the disk tier's files (blocks the prefix cache evicted,
  :mod:`kvserve.core.kv_offload`): each worker copies its shard of the blocks out when it applies
  the op (before anything later writes them) and writes the files in a background thread; the
  batch also names files to delete (the tier's least recently used, beyond its budget), deleted
  after the writes;
* ``compact``: a request's KV compaction (:mod:`kvserve.core.kv_compression`): the kept tokens
  of its old blocks moved to the first slots of its new ones (:class:`Compaction`; a batch of its
  own, every kept token read before any is written, so old and new blocks may overlap);
* ``forget``: drop the attention scores a worker keeps for a request's compression (it finished
  or is recomputed).

Semantics: the ops of a :class:`KVCacheOps` mean exactly what applying them one by one, in the
order recorded, would do. For speed, consecutive moves of one kind are kept together in a
:class:`BlockMoves` batch that a worker applies with one gather (``index_select``) and one
scatter (``index_copy_``) per layer and K/V: every source is read before any destination is
written. That equals the one-by-one order unless a move reads a block that an earlier move of
the batch wrote, or writes a block that an earlier move of the batch wrote (the scatter of
duplicate indices is unordered); the recorder then starts a new batch. (A move that writes a
block an earlier move read is fine: the gather reads it first.)

Why the order is enough: every op recorded before a forward is applied before it, so the pools
a forward reads are those an immediate copy would have left. Ops recorded after a step (forks,
beam clones) or around an abort wait for the next forward; they are never dropped (a block an
op writes may enter the prefix cache, e.g. a swapped-in request's blocks when it is freed), and
a later op or forward on a block that was freed and reused in between runs after them.

Everything here is plain ints in lists (and, for a load, the connector's small handle; for an
offload, the 16-byte keys of its files): cheap to record and to pickle to another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

#: Move kinds (:attr:`BlockMoves.kind`).
COPY = "copy"
SWAP_OUT = "swap_out"
SWAP_IN = "swap_in"
LOAD = "load"
OFFLOAD = "offload"
COMPACT = "compact"
FORGET = "forget"
KINDS = (COPY, SWAP_OUT, SWAP_IN, LOAD, OFFLOAD, COMPACT, FORGET)


@dataclass(slots=True)
class Compaction:
    """One request's KV compaction, applied by every worker to its own pools (its KV heads).

    Attributes:
        request_id: the request (the key of the worker's attention scores for it).
        src_table, src_len: the old block table and its KV length (tokens): KV index j lives in
            slot ``src_table[j // block_size] · block_size + j % block_size``.
        dst_table, dst_len: the new table and the kept tokens (KV indices ``0 .. dst_len - 1``).
        method: ``"streaming_llm"``, ``"snapkv"`` or ``"h2o"``.
        keep: ``dst_len`` ascending old KV indices kept, the same in every layer and head
            (StreamingLLM); None when the worker selects them per layer and head from its scores
            (SnapKV, H2O: :mod:`kvserve.worker.kv_compressor`).
        params: the policy (:meth:`KVCompressionConfig.to_dict`).
        src_residual: 2-/4-bit pools (:mod:`kvserve.worker.kv_quant_lowbit`): the residual slot of
            each ``src_table`` entry at the compaction (-1: none, a full quantized block; a
            sequence's partial last block has one); empty for other formats.
        dst_residual: 2-/4-bit pools: the residual slot of ``dst_table[-1]`` when ``dst_len`` is
            not a multiple of ``block_size`` (the kept tokens' partial last block, in the model
            dtype), else -1.
    """

    request_id: str
    src_table: list[int]
    src_len: int
    dst_table: list[int]
    dst_len: int
    method: str
    keep: Optional[list[int]] = None
    params: dict = field(default_factory=dict)
    src_residual: list[int] = field(default_factory=list)
    dst_residual: int = -1


class KVCacheOpsError(RuntimeError):
    """A worker failed to apply a step's KV ops: its pools no longer match the core's books (an
    engine fault, not one request's; the engine core does not retry the step without them)."""


@dataclass(slots=True)
class BlockMoves:
    """One batch of moves of one kind, applied at once (gather every source, then scatter).

    Attributes:
        kind: :data:`COPY` (device → device), :data:`SWAP_OUT` (device → host),
            :data:`SWAP_IN` (host → device), :data:`LOAD` (a connector's payload → device) or
            :data:`OFFLOAD` (device → the disk tier's files).
        src, dst: block ids, one per move (device or host block ids as ``kind`` says; for a
            load, the indices of the blocks in the payload; for an offload, the device blocks
            and the indices of their keys in ``source``).
        num_tokens: :data:`COPY` only: the leading slots of each block moved (``1 ..
            block_size``); empty for swaps and loads, which move whole blocks.
        source: :data:`LOAD`: the :class:`~kvserve.distributed.kv_transfer.KVTransferHandle`
            of the payload (one batch per handle). :data:`OFFLOAD`: ``(keys, drop)``, the file
            keys of the blocks written (``keys[dst[i]]`` for ``src[i]``) and those of the files to
            delete after the writes (tuples of 16-byte keys). :data:`SWAP_OUT` / :data:`SWAP_IN`
            of 2-/4-bit pools: None, or ``[src_slots, dst_slots]``, the residual slots moved with
            the blocks (a sequence's partial last block, whose rows are in a model-dtype residual
            slot: :mod:`kvserve.worker.kv_quant_lowbit`), device → host slots for a swap-out,
            host → device for a swap-in, pairwise.
    """

    kind: str
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    source: object = None

    def __len__(self) -> int:
        return len(self.src)


@dataclass(slots=True)
class KVCacheOps:
    """An ordered record of block moves (module docstring): ``batches`` in order, each a
    :class:`BlockMoves`. Falsy when empty.

    The recording methods (:meth:`copy`, :meth:`swap_out`, :meth:`swap_in`) are the core's;
    :meth:`take` hands what was recorded to a step and leaves the recorder empty.
    """

    batches: list[BlockMoves] = field(default_factory=list)
    # blocks the last batch writes (its destination space): the hazard check (not sent along)
    _written: set[int] = field(default_factory=set, repr=False, compare=False)

    # ------------------------------------------------------------------ recording
    def _batch(self, kind: str, reads_written_space: Sequence[int], dst: Sequence[int]) -> BlockMoves:
        """The batch to append moves of ``kind`` to: the last one if it has that kind and none of
        ``reads_written_space`` (sources in its destination space) nor ``dst`` was written by
        it, else a new one."""
        last = self.batches[-1] if self.batches else None
        w = self._written
        if last is None or last.kind != kind or any(b in w for b in reads_written_space) or any(b in w for b in dst):
            last = BlockMoves(kind)
            self.batches.append(last)
            w.clear()
        return last

    def copy(self, src: int, dst: int, num_tokens: int) -> None:
        """Record a copy of slots ``0 .. num_tokens - 1`` of device block ``src`` into device
        block ``dst`` (``1 <= num_tokens <= block_size``; ``src != dst``)."""
        if src == dst or num_tokens < 1:
            raise ValueError(f"copy of block {src} into {dst} ({num_tokens} tokens)")
        b = self._batch(COPY, (src,), (dst,))
        b.src.append(src)
        b.dst.append(dst)
        b.num_tokens.append(num_tokens)
        self._written.add(dst)

    def swap_out(self, device_blocks: Sequence[int], host_blocks: Sequence[int],
                 residual: Optional[tuple[int, int]] = None) -> None:
        """Record the copy of whole device blocks into host blocks, pairwise; with ``residual``
        ``(device_slot, host_slot)``, also the copy of a 2-/4-bit pool's residual slot into the
        host pool's (:attr:`BlockMoves.source`)."""
        self._swap(SWAP_OUT, device_blocks, host_blocks, residual)

    def swap_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int],
                residual: Optional[tuple[int, int]] = None) -> None:
        """Record the copy of whole host blocks into device blocks, pairwise; with ``residual``
        ``(host_slot, device_slot)``, also the copy of a host residual slot into a device one."""
        self._swap(SWAP_IN, host_blocks, device_blocks, residual)

    def load(self, source, payload_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Record the copy of blocks ``payload_blocks`` of a connector's payload (``source``: its
        :class:`~kvserve.distributed.kv_transfer.KVTransferHandle`) into device blocks, pairwise.
        A load is a batch of its own."""
        if len(payload_blocks) != len(device_blocks) or len(set(device_blocks)) != len(device_blocks):
            raise ValueError(f"load: {len(payload_blocks)} payload blocks into device blocks {list(device_blocks)}")
        if not payload_blocks:
            return
        b = BlockMoves(LOAD, list(payload_blocks), list(device_blocks), source=source)
        self.batches.append(b)
        self._written.clear()
        self._written.update(device_blocks)

    def offload(self, device_blocks: Sequence[int], keys: Sequence[bytes], drop: Sequence[bytes] = ()) -> None:
        """Record the writing of device blocks to the disk tier's files ``keys`` (pairwise), then
        the deletion of the files ``drop``. An offload is a batch of its own."""
        if len(device_blocks) != len(keys):
            raise ValueError(f"offload: {len(device_blocks)} device blocks for {len(keys)} keys")
        if not keys and not drop:
            return
        n = len(device_blocks)
        self.batches.append(BlockMoves(OFFLOAD, list(device_blocks), list(range(n)), source=(tuple(keys), tuple(drop))))
        self._written.clear()  # (reads device blocks, writes none)
    def compact(self, c: Compaction) -> None:
        """Record a request's KV compaction (a batch of its own: ``source`` is the
        :class:`Compaction`)."""
        self.batches.append(BlockMoves(COMPACT, [c.src_len], [c.dst_len], source=c))
        self._written.clear()
        self._written.update(c.dst_table)

    def forget(self, request_id: str) -> None:
        """Record that the workers drop their compression scores of ``request_id``."""
        self.batches.append(BlockMoves(FORGET, [0], [0], source=request_id))
        self._written.clear()

    def _swap(self, kind: str, src: Sequence[int], dst: Sequence[int],
              residual: Optional[tuple[int, int]] = None) -> None:
        if len(src) != len(dst):
            raise ValueError(f"{kind}: {len(src)} source blocks for {len(dst)} destination blocks")
        if len(set(dst)) != len(dst):
            raise ValueError(f"{kind}: a destination block repeats: {list(dst)}")
        if not src:
            return
        b = self._batch(kind, (), dst)  # (sources are in the other space: never written by this batch)
        if residual is not None and b.source is not None and residual[1] in b.source[1]:
            b = BlockMoves(kind)  # (a residual slot this batch writes already: in order, a new batch)
            self.batches.append(b)
            self._written.clear()
        b.src.extend(src)
        b.dst.extend(dst)
        self._written.update(dst)
        if residual is not None:
            if b.source is None:
                b.source = [[], []]
            b.source[0].append(int(residual[0]))
            b.source[1].append(int(residual[1]))

    # ------------------------------------------------------------------ handing over
    def take(self) -> "KVCacheOps":
        """The ops recorded so far (a new object, to send with a step); this recorder is left
        empty and starts a new batch next."""
        out = KVCacheOps(self.batches)
        self.batches = []
        self._written.clear()
        return out

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        """The number of moves (blocks moved)."""
        return sum(len(b) for b in self.batches)

    def __bool__(self) -> bool:
        return bool(self.batches)

    def moves(self) -> list[tuple]:
        """Every move in order, one tuple each: ``("copy", src, dst, num_tokens)``,
        ``("swap_out", device_block, host_block)``, ``("swap_in", host_block, device_block)``,
        ``("load", payload_block, device_block)``, ``("offload", device_block, key_index)``."""
        out: list[tuple] = []
        for b in self.batches:
            if b.kind == COPY:
                out.extend((COPY, s, d, n) for s, d, n in zip(b.src, b.dst, b.num_tokens))
            elif b.kind in (COMPACT, FORGET):
                out.append((b.kind, b.source))
            else:
                out.extend((b.kind, s, d) for s, d in zip(b.src, b.dst))
        return out
