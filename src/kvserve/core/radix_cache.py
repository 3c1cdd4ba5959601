"""RadixCache: prefix caching on a radix tree over the paged KV blocks.

Algorithm: SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", 2023, arXiv:2312.07104), adapted to paged blocks:

* The tree caches only **full** blocks. A node holds a run of token ids whose length is a
  multiple of ``block_size`` and the ids of the blocks that store their K/V. Children are
  keyed by the token tuple of their first block, so a lookup compares real tokens (there
  is no hash of our own that could collide).
* Every cached run lives under a **namespace**: what makes K/V differ for the same tokens
  (model, adapter, ``cache_salt``; see :func:`make_namespace`). Each namespace has its own
  child of the root, so runs of different namespaces never share a node.
* :meth:`RadixCache.match_prefix` walks down block by block and splits a node at a block
  boundary where the match ends inside it. Beyond the full blocks it reports a
  token-granular *partial* match: the first block of a diverging child that agrees with
  the next 1..block_size-1 tokens; the caller copies those tokens' K/V into a block of its
  own.
* Lock references protect the path root..node while a running request uses it; only
  unlocked leaves are evicted, least recently used first, so a parent becomes a candidate
  when its last child goes.

Units: token counts are tokens; block counts and block ids are KV blocks of
``block_size`` tokens from the :class:`~kvserve.core.block_pool.BlockPool`.

Reference counts: the tree holds exactly one pool reference on each block it stores.
Requests hold their own references. The engine keeps the rule that *every cached block a
running request references lies on the path of a node that request has locked*; then the
blocks of unlocked nodes are referenced by the tree alone, :attr:`evictable_blocks` is
exactly what :meth:`evict` can free, and ``pool.num_free + evictable + in_use ==
num_blocks`` holds.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Optional, Sequence

from kvserve.core.block_pool import BlockPool

Namespace = tuple[tuple[str, Hashable], ...]
"""Key of a cache namespace: a tuple of tagged ``(kind, value)`` pairs."""


def make_namespace(
    model: str, adapter: Optional[Hashable] = None, cache_salt: Optional[str] = None
) -> Namespace:
    """Namespace of a request's cached K/V: ``(("model", m), ("adapter", a), ("salt", s))``.

    Each value sits in its own tagged slot, so a salt equal to an adapter id cannot match
    that adapter's cache. Requests without adapter and salt share one default namespace
    per model.
    """
    return (("model", model), ("adapter", adapter), ("salt", cache_salt))


@dataclass(eq=False, slots=True)
class RadixNode:
    """One node of the radix tree.

    Attributes:
        tokens: the node's token run; ``len(tokens) == len(blocks) * block_size``
            (empty for the root and for namespace roots).
        blocks: KV block ids storing ``tokens``, one per ``block_size`` tokens.
        parent: ``None`` for the root and for nodes removed from the tree.
        children: child nodes keyed by the token tuple of their first block (the root's
            children, the namespace roots, are keyed by namespace).
        lock_ref: number of locks on this node or below it (a parent's ≥ its child's).
        last_access: logical clock of the last match or insert that passed here.
        namespace: the namespace of the subtree (``None`` for the root).
        depth: tokens from the namespace root to the end of this node (0 for a
            namespace root, -1 for the root); a split keeps it for the lower node, so a
            locked node always stands for the same prefix.
    """

    tokens: tuple[int, ...]
    blocks: list[int]
    parent: Optional["RadixNode"]
    namespace: Optional[Namespace]
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    depth: int = 0
    queued: bool = False  # has an entry in the eviction heap


@dataclass(frozen=True, slots=True)
class PartialMatch:
    """The next tokens agree with the first ``num_tokens`` tokens of a cached block.

    Attributes:
        node: the tree node whose first block is ``block_id`` (lock it until the copy ran).
        block_id: the cached block to copy K/V from (its slots ``0..num_tokens-1``).
        num_tokens: tokens to copy, ``1 ≤ num_tokens ≤ block_size - 1``.
    """

    node: RadixNode
    block_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`RadixCache.match_prefix`.

    Attributes:
        blocks: cached full blocks holding the first ``num_tokens`` tokens, in order.
        num_tokens: matched tokens, ``len(blocks) * block_size``.
        node: the deepest matched node (the namespace root or the tree root when no block
            matched); pass it to :meth:`RadixCache.lock`.
        partial: a token-granular match inside the next block, or ``None``.
    """

    blocks: list[int]
    num_tokens: int
    node: RadixNode
    partial: Optional[PartialMatch] = None

    @property
    def num_blocks(self) -> int:
        """Matched full blocks."""
        return len(self.blocks)


@dataclass(slots=True)
class CacheStats:
    """Token counters of :meth:`RadixCache.match_prefix` calls.

    Attributes:
        query_tokens: tokens asked for (after the ``max_tokens`` cap).
        hit_tokens: tokens served from cached full blocks.
        partial_hit_tokens: tokens served by copying from a partially matching block.
    """

    query_tokens: int = 0
    hit_tokens: int = 0
    partial_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """``(hit_tokens + partial_hit_tokens) / query_tokens`` (0 when nothing was asked)."""
        if self.query_tokens == 0:
            return 0.0
        return (self.hit_tokens + self.partial_hit_tokens) / self.query_tokens


class RadixCache:
    """Prefix cache of full KV blocks on a radix tree (SGLang RadixAttention, by blocks).

    Args:
        pool: the block pool whose blocks the tree references (one reference per block
            it stores, taken in :meth:`insert` and dropped in :meth:`evict`).
        on_evict: called with the ids of the blocks :meth:`evict` removes, before their
            reference is dropped (the disk tier writes them: :mod:`kvserve.core.kv_offload`).

    Complexity (a path has one node per :meth:`insert` call that added blocks to it):
    match costs O(matched tokens + nodes on the path + children of the last node);
    insert the same, or O(new blocks) from a ``start`` node; lock/unlock O(nodes on the
    path), move_lock O(nodes between the two nodes); evict O(k log n) for k removed
    nodes (a lazy min-heap of leaves ordered by last access).
    """

    def __init__(self, pool: BlockPool, on_evict: Optional[Callable[[list[int]], None]] = None) -> None:
        self.pool = pool
        self.on_evict = on_evict
        self.block_size = pool.block_size
        self.root = RadixNode(tokens=(), blocks=[], parent=None, namespace=None, depth=-1)
        self.stats = CacheStats()
        self._clock = 0
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._cached: set[int] = set()
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ counters
    @property
    def num_cached_blocks(self) -> int:
        """Blocks stored in the tree (each holds one tree reference)."""
        return len(self._cached)

    @property
    def evictable_blocks(self) -> int:
        """Blocks in unlocked nodes: what :meth:`evict` can free."""
        return self._evictable

    @property
    def protected_blocks(self) -> int:
        """Blocks in locked nodes (in use by running requests)."""
        return self._protected

    def is_cached(self, block_id: int) -> bool:
        """Whether the tree stores ``block_id``."""
        return block_id in self._cached

    def reset_stats(self) -> None:
        """Zero the hit/query token counters."""
        self.stats = CacheStats()

    # ------------------------------------------------------------------ match
    def match_prefix(
        self,
        namespace: Namespace,
        token_ids: Sequence[int],
        max_tokens: Optional[int] = None,
        *,
        update_stats: bool = True,
    ) -> PrefixMatch:
        """Longest cached block-aligned prefix of ``token_ids[:max_tokens]``.

        Splits the node where the match ends inside it (so that :meth:`lock` protects
        exactly the matched blocks) and refreshes the last-access time of the path. Lock
        the returned node before anything can evict (see :meth:`lock`).

        Args:
            namespace: see :func:`make_namespace`.
            token_ids: the prompt (or prompt + output) token ids.
            max_tokens: match at most this many tokens. Pass ``len(prompt) - 1`` so the
                last prompt token is always computed (no prefill is empty).
            update_stats: add this query to :attr:`stats` (turn off when re-querying
                a request that is still waiting for admission).

        Returns:
            The matched full blocks, their token count, the deepest matched node and an
            optional partial match in the block after them (counted within the cap).

        Raises:
            ValueError: if ``max_tokens`` is negative.
            TypeError: if ``namespace`` is not a tuple.
        """
        _check_namespace(namespace)
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be ≥ 0, got {max_tokens}")
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
        query = tuple(token_ids[:limit])
        bs = self.block_size
        now = self._tick()
        node = self.root.children.get(namespace)
        blocks: list[int] = []
        pos = 0
        partial = None
        if node is None:
            node = self.root
        else:
            node.last_access = now
            while limit - pos >= bs:
                child = node.children.get(query[pos : pos + bs])
                if child is None:
                    break
                n = self._common_blocks(child, query, pos)
                if n < len(child.blocks):
                    child = self._split(child, n)
                child.last_access = now
                blocks.extend(child.blocks)
                pos += n * bs
                node = child
            partial = self._partial_match(node, query, pos, now)
        if update_stats:
            self.stats.query_tokens += limit
            self.stats.hit_tokens += pos
            if partial is not None:
                self.stats.partial_hit_tokens += partial.num_tokens
        return PrefixMatch(blocks=blocks, num_tokens=pos, node=node, partial=partial)

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        namespace: Namespace,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        start: Optional[RadixNode] = None,
    ) -> RadixNode:
        """Cache the full blocks ``block_ids`` holding ``token_ids``; return the deepest node.

        Walks the cached prefix (splitting where ``token_ids`` ends inside a node) and
        adds the rest as a new leaf, taking one pool reference on each newly stored
        block. Where a run is already cached under the same tokens the tree keeps its own
        block and the caller's block at that position is not adopted (the caller still
        drops its own reference as usual).

        With a growing prefix (chunked prefill, decode) pass ``start``: the node the
        request holds locked (from its match or its previous insert). The walk then
        begins there, so the call costs O(new blocks) instead of O(path).

        Args:
            namespace: see :func:`make_namespace`.
            token_ids: block-aligned tokens, ``len(token_ids) == len(block_ids) * block_size``.
            block_ids: the caller's blocks for those tokens; each must be in use.
            start: optional node in the tree whose path spells
                ``token_ids[:start.depth]`` (the tree root or a namespace root mean "from
                the top").

        Returns:
            The node whose path from the root spells exactly ``token_ids`` (the namespace
            root when ``token_ids`` is empty). Lock it to protect the cached path.

        Raises:
            ValueError: on a length mismatch, a block id out of range or free, a repeated
                block among the new ones, a new block the tree already stores elsewhere
                (an engine bug that would corrupt reference counts), or a ``start`` that
                was evicted, is of another namespace, or does not end with the tokens at
                ``token_ids[start.depth - len(start.tokens):start.depth]``.
            TypeError: if ``namespace`` is not a tuple.
        """
        _check_namespace(namespace)
        bs = self.block_size
        if len(token_ids) != len(block_ids) * bs:
            raise ValueError(
                f"len(token_ids)={len(token_ids)} != len(block_ids)={len(block_ids)}"
                f" * block_size={bs}"
            )
        if start is not None and start.depth > 0:
            self._check_start(start, namespace, token_ids)
            node, base = start, start.depth
        else:
            node = self.root.children.get(namespace)
            if node is None:
                node = RadixNode(tokens=(), blocks=[], parent=self.root, namespace=namespace)
                self.root.children[namespace] = node
            base = 0
        query = tuple(token_ids[base:])  # positions below are relative to ``base``
        blocks = list(block_ids[base // bs :])
        for b in blocks:
            if not 0 <= b < self.pool.num_blocks or self.pool.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not an allocated block of the pool")
        now = self._tick()
        node.last_access = now
        pos = 0
        while pos < len(query):
            child = node.children.get(query[pos : pos + bs])
            if child is None:
                return self._add_leaf(node, query[pos:], blocks[pos // bs :], now)
            n = self._common_blocks(child, query, pos)
            if n < len(child.blocks):
                child = self._split(child, n)
            child.last_access = now
            pos += n * bs
            node = child
        return node

    # ------------------------------------------------------------------ locks
    def lock(self, node: RadixNode) -> None:
        """Protect the path root..``node`` from eviction (one lock reference each).

        Raises:
            ValueError: if ``node`` was evicted (is no longer in the tree).
        """
        self._check_attached(node)
        self._lock_path(node, None)

    def unlock(self, node: RadixNode) -> None:
        """Drop one lock reference from each node on the path root..``node``.

        Nodes left unlocked become evictable; unlocked leaves join the LRU queue.

        Raises:
            ValueError: if ``node`` is no longer in the tree.
            RuntimeError: if ``node`` is not locked.
        """
        self._check_attached(node)
        if node.lock_ref <= 0:
            raise RuntimeError("unlock of a node that is not locked")
        self._unlock_path(node, None)

    def move_lock(self, old: RadixNode, new: RadixNode) -> None:
        """``lock(new); unlock(old)`` touching only the nodes below their common ancestor.

        For a request whose cached prefix grew (``new`` = the node :meth:`insert`
        returned): O(nodes between ``old`` and ``new``) instead of O(depth).

        Raises:
            ValueError: if either node is no longer in the tree.
            RuntimeError: if ``old`` is not locked.
        """
        self._check_attached(old)
        self._check_attached(new)
        if old.lock_ref <= 0:
            raise RuntimeError("move_lock from a node that is not locked")
        a, b = old, new
        while a is not b:  # depth strictly grows downwards: climb to the common ancestor
            if a.depth >= b.depth:
                a = a.parent  # type: ignore[assignment]
            else:
                b = b.parent  # type: ignore[assignment]
        self._lock_path(new, a)
        self._unlock_path(old, a)

    def ancestor_at(self, node: RadixNode, depth: int) -> RadixNode:
        """The node on the path root..``node`` that ends exactly at ``depth`` tokens, splitting
        the node that spans it (locks are kept). For a request that keeps only a prefix of
        its locked path (a beam cloned at fewer tokens).

        Args:
            depth: a multiple of ``block_size``, ``0 ≤ depth ≤ node.depth``.

        Raises:
            ValueError: if ``node`` was evicted, or ``depth`` is not block-aligned or not in
                ``[0, node.depth]``.
        """
        self._check_attached(node)
        if depth % self.block_size or not 0 <= depth <= max(node.depth, 0):
            raise ValueError(f"depth {depth} is not a block boundary in [0, {max(node.depth, 0)}]")
        cur = node
        while cur.parent is not None and cur.parent is not self.root and cur.parent.depth >= depth:
            cur = cur.parent
        if cur.depth == depth or cur is self.root:
            return cur
        return self._split(cur, (depth - (cur.depth - len(cur.tokens))) // self.block_size)

    def _lock_path(self, node: RadixNode, stop: Optional[RadixNode]) -> None:
        cur: Optional[RadixNode] = node
        while cur is not stop:
            assert cur is not None
            if cur.lock_ref == 0:
                self._evictable -= len(cur.blocks)
                self._protected += len(cur.blocks)
            cur.lock_ref += 1
            cur = cur.parent

    def _unlock_path(self, node: RadixNode, stop: Optional[RadixNode]) -> None:
        cur: Optional[RadixNode] = node
        while cur is not stop:
            assert cur is not None
            parent = cur.parent
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._evictable += len(cur.blocks)
                self._protected -= len(cur.blocks)
                if not cur.children and cur is not self.root:
                    if cur.blocks:
                        self._push(cur)
                    else:
                        self._drop_namespace(cur)
            cur = parent

    # ------------------------------------------------------------------ evict
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks from unlocked leaves, least recently used first.

        A leaf is removed whole when it has no more blocks than are still needed;
        otherwise its last blocks are trimmed (its prefix stays cached). A parent whose
        last child goes becomes a candidate in turn. Each removed block loses the tree's
        reference, which frees it (unlocked blocks are referenced by the tree alone).

        Returns:
            Blocks released: ``min(num_blocks, evictable_blocks)`` taken before the call.

        Raises:
            ValueError: if ``num_blocks`` is negative.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be ≥ 0, got {num_blocks}")
        freed = 0
        while freed < num_blocks and self._heap:
            access, _, node = heapq.heappop(self._heap)
            node.queued = False
            if not self._is_evictable_leaf(node):
                continue
            if access != node.last_access:  # touched since queued: requeue at its time
                self._push(node)
                continue
            need = num_blocks - freed
            if len(node.blocks) <= need:
                freed += len(node.blocks)
                self._remove_leaf(node)
            else:
                self._trim(node, need)
                freed += need
        return freed

    # ------------------------------------------------------------------ inspection
    def iter_nodes(self) -> Iterator[RadixNode]:
        """All nodes below the root (namespace roots included), parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recount the tree and compare with the counters; O(nodes). For tests and debugging.

        Raises:
            RuntimeError: naming the first broken invariant.
        """
        bs = self.block_size
        cached: list[int] = []
        evictable = protected = 0
        for node in self.iter_nodes():
            parent = node.parent
            if parent is None or node.lock_ref > parent.lock_ref or node.lock_ref < 0:
                raise RuntimeError("lock_ref of a node exceeds its parent's")
            if len(node.tokens) != len(node.blocks) * bs:
                raise RuntimeError("node tokens are not its blocks times block_size")
            if node.depth != max(parent.depth, 0) + len(node.tokens):
                raise RuntimeError("node depth is not its parent's plus its tokens")
            if parent is not self.root and (
                not node.blocks or parent.children.get(node.tokens[:bs]) is not node
            ):
                raise RuntimeError("node is empty or keyed wrongly under its parent")
            cached.extend(node.blocks)
            if node.lock_ref:
                protected += len(node.blocks)
            else:
                evictable += len(node.blocks)
        if len(cached) != len(set(cached)) or set(cached) != self._cached:
            raise RuntimeError("cached block set does not match the tree")
        if (evictable, protected) != (self._evictable, self._protected):
            raise RuntimeError(
                f"counters evictable={self._evictable} protected={self._protected},"
                f" tree has {evictable} and {protected}"
            )
        for b in cached:
            if self.pool.ref_counts[b] <= 0:
                raise RuntimeError(f"cached block {b} is free in the pool")

    # ------------------------------------------------------------------ internals
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _common_blocks(self, child: RadixNode, query: tuple[int, ...], pos: int) -> int:
        """Leading blocks of ``child`` equal to ``query[pos:]`` (≥ 1: the key matched)."""
        bs = self.block_size
        end = pos + len(child.tokens)
        if end <= len(query) and query[pos:end] == child.tokens:
            return len(child.blocks)
        n = 1
        while n < len(child.blocks):
            a = pos + n * bs
            if a + bs > len(query) or query[a : a + bs] != child.tokens[n * bs : (n + 1) * bs]:
                break
            n += 1
        return n

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut ``child`` after its first ``n`` blocks; return the new upper node."""
        bs = self.block_size
        parent = child.parent
        assert parent is not None
        top = RadixNode(
            tokens=child.tokens[: n * bs],
            blocks=child.blocks[:n],
            parent=parent,
            namespace=child.namespace,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
            depth=child.depth - len(child.tokens) + n * bs,
        )
        child.tokens = child.tokens[n * bs :]
        child.blocks = child.blocks[n:]
        child.parent = top
        top.children[child.tokens[:bs]] = child
        parent.children[top.tokens[:bs]] = top
        return top

    def _partial_match(
        self, node: RadixNode, query: tuple[int, ...], pos: int, now: int
    ) -> Optional[PartialMatch]:
        """Best child of ``node`` whose first block agrees with 1..bs-1 next tokens.

        Only that first block is used (copied), so only it counts as accessed: a child of
        several blocks is split after its first (as a full match splits where it ends) and the
        new one-block node is touched, not the child's whole run. (Touching the whole child let
        every prompt that shared a first token with a long cached prompt refresh all of that
        prompt's blocks, which then never aged out of the LRU order.)"""
        m = min(self.block_size - 1, len(query) - pos)
        if m <= 0:
            return None
        target = query[pos : pos + m]
        best: Optional[RadixNode] = None
        best_n = 0
        for child in node.children.values():
            tokens = child.tokens
            if tokens[0] != target[0]:
                continue
            n = 1
            while n < m and tokens[n] == target[n]:
                n += 1
            if n > best_n:
                best, best_n = child, n
                if n == m:
                    break
        if best is None:
            return None
        if len(best.blocks) > 1:
            best = self._split(best, 1)
        best.last_access = now
        return PartialMatch(node=best, block_id=best.blocks[0], num_tokens=best_n)

    def _add_leaf(
        self, parent: RadixNode, tokens: tuple[int, ...], blocks: list[int], now: int
    ) -> RadixNode:
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"repeated block ids among {blocks}")
        for b in blocks:
            if b in self._cached:
                raise ValueError(f"block {b} is already cached under other tokens")
        self.pool.incref(blocks)
        self._cached.update(blocks)
        leaf = RadixNode(
            tokens=tokens, blocks=blocks, parent=parent, namespace=parent.namespace,
            last_access=now, depth=parent.depth + len(tokens),
        )
        parent.children[tokens[: self.block_size]] = leaf
        self._evictable += len(blocks)
        self._push(leaf)
        return leaf

    def _push(self, node: RadixNode) -> None:
        if not node.queued:
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
            node.queued = True

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return (
            node.parent is not None
            and node.lock_ref == 0
            and not node.children
            and bool(node.blocks)
        )

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self.block_size]]
        node.parent = None
        self._release(node.blocks)
        node.blocks = []
        node.tokens = ()
        if parent.lock_ref == 0 and not parent.children:
            if parent.blocks:
                self._push(parent)
            else:
                self._drop_namespace(parent)

    def _trim(self, node: RadixNode, n: int) -> None:
        """Drop the last ``n`` (< all) blocks of an unlocked leaf; it stays a candidate."""
        removed = node.blocks[-n:]
        node.blocks = node.blocks[:-n]
        node.tokens = node.tokens[: -n * self.block_size]
        node.depth -= n * self.block_size
        self._release(removed)
        self._push(node)

    def _release(self, blocks: list[int]) -> None:
        if self.on_evict is not None:
            self.on_evict(blocks)
        self._evictable -= len(blocks)
        self._cached.difference_update(blocks)
        self.pool.decref(blocks)

    def _drop_namespace(self, ns_root: RadixNode) -> None:
        """Remove an empty, unlocked namespace root."""
        if ns_root.parent is self.root and not ns_root.children and ns_root.lock_ref == 0:
            del self.root.children[ns_root.namespace]
            ns_root.parent = None

    def _check_start(
        self, start: RadixNode, namespace: Namespace, token_ids: Sequence[int]
    ) -> None:
        self._check_attached(start)
        lo = start.depth - len(start.tokens)
        if (
            start.namespace != namespace
            or start.depth > len(token_ids)
            or tuple(token_ids[lo : start.depth]) != start.tokens
        ):
            raise ValueError("start node does not spell a prefix of token_ids in namespace")

    def _check_attached(self, node: RadixNode) -> None:
        if node.parent is None and node is not self.root:
            raise ValueError("node is no longer in the tree (evicted); match again")


def _check_namespace(namespace: object) -> None:
    if not isinstance(namespace, tuple):
        raise TypeError(f"namespace must be a tuple (see make_namespace), got {namespace!r}")
