"""Tests of the radix prefix cache: unit cases and a stateful model check with BlockPool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.core.block_pool import BlockPool
from kvserve.core.radix_cache import RadixCache, RadixNode, make_namespace

NS = make_namespace("m")


def _cache(num_blocks: int = 32, block_size: int = 4) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks, block_size)
    return pool, RadixCache(pool)


def _put(
    pool: BlockPool, cache: RadixCache, tokens: list[int], ns: tuple = NS
) -> tuple[RadixNode, list[int]]:
    """Simulate a request that computed ``tokens`` (block-aligned) and finished."""
    blocks = pool.allocate(len(tokens) // pool.block_size)
    node = cache.insert(ns, tokens, blocks)
    pool.decref(blocks)
    return node, blocks


def _depth_blocks(node: RadixNode) -> int:
    n = 0
    while node is not None:
        n += len(node.blocks)
        node = node.parent
    return n


# ----------------------------------------------------------------------------- unit tests
def test_match_empty_cache_and_namespace_validation() -> None:
    pool, cache = _cache()
    m = cache.match_prefix(NS, [1, 2, 3, 4, 5])
    assert m.blocks == [] and m.num_tokens == 0 and m.partial is None and m.node is cache.root
    with pytest.raises(TypeError):
        cache.match_prefix("m", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cache.match_prefix(NS, [1], max_tokens=-1)


def test_split_in_middle_of_node() -> None:
    pool, cache = _cache(block_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    node, blocks = _put(pool, cache, toks)
    assert len(list(cache.iter_nodes())) == 2  # namespace root + one node of 4 blocks
    m = cache.match_prefix(NS, [1, 2, 3, 4, 9, 9])
    assert m.blocks == blocks[:2] and m.num_tokens == 4
    assert m.node.tokens == (1, 2, 3, 4) and m.node.blocks == blocks[:2]
    (lower,) = m.node.children.values()
    assert lower is node and lower.tokens == (5, 6, 7, 8) and lower.blocks == blocks[2:]
    assert cache.num_cached_blocks == 4 and cache.evictable_blocks == 4
    # The full run still matches across the split.
    assert cache.match_prefix(NS, toks).blocks == blocks
    # A divergent insert becomes a sibling of the lower half.
    node2, blocks2 = _put(pool, cache, [1, 2, 3, 4, 9, 9])
    assert node2.parent is m.node and len(m.node.children) == 2
    assert cache.match_prefix(NS, [1, 2, 3, 4, 9, 9, 0]).blocks == blocks[:2] + blocks2[2:]
    cache.check_invariants()


def test_split_keeps_lock_of_locked_node() -> None:
    pool, cache = _cache(block_size=2)
    node, blocks = _put(pool, cache, [1, 2, 3, 4, 5, 6])
    cache.lock(node)
    assert cache.protected_blocks == 3
    m = cache.match_prefix(NS, [1, 2, 7, 7])  # splits the locked node
    assert m.node.lock_ref == 1 and m.node is node.parent
    cache.check_invariants()
    cache.unlock(node)
    assert cache.protected_blocks == 0 and cache.evictable_blocks == 3
    assert all(n.lock_ref == 0 for n in cache.iter_nodes()) and cache.root.lock_ref == 0
    cache.check_invariants()
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_same_first_token_and_same_first_block_kept_apart() -> None:
    pool, cache = _cache(block_size=2)
    _, a = _put(pool, cache, [1, 2, 3, 4])
    _, b = _put(pool, cache, [1, 3, 3, 4])  # same first token
    _, c = _put(pool, cache, [1, 2, 3, 5])  # same first block
    assert cache.match_prefix(NS, [1, 2, 3, 4]).blocks == a
    assert cache.match_prefix(NS, [1, 3, 3, 4]).blocks == b
    assert cache.match_prefix(NS, [1, 2, 3, 5]).blocks == [a[0], c[1]]
    assert cache.num_cached_blocks == 5
    cache.check_invariants()


class CollidingInt(int):
    """A token id whose hash collides with every other token id."""

    def __hash__(self) -> int:
        return 0


def test_forced_hash_collision_is_told_apart_by_tokens() -> None:
    pool, cache = _cache(block_size=2)
    x = [CollidingInt(t) for t in (1, 2, 3, 4)]
    y = [CollidingInt(t) for t in (5, 6, 7, 8)]
    assert hash(tuple(x[:2])) == hash(tuple(y[:2]))  # child keys collide
    _, bx = _put(pool, cache, x)
    _, by = _put(pool, cache, y)
    assert cache.match_prefix(NS, x).blocks == bx
    assert cache.match_prefix(NS, y).blocks == by
    assert cache.match_prefix(NS, [CollidingInt(t) for t in (9, 9, 9, 9)]).blocks == []
    # Namespaces whose hashes collide are still told apart.
    ns_a = (("model", CollidingInt(1)),)
    ns_b = (("model", CollidingInt(2)),)
    assert hash(ns_a) == hash(ns_b)
    _, ba = _put(pool, cache, [1, 2], ns=ns_a)
    assert cache.match_prefix(ns_a, [1, 2]).blocks == ba
    assert cache.match_prefix(ns_b, [1, 2]).blocks == []


def test_namespaces_isolate() -> None:
    pool, cache = _cache(block_size=2)
    toks = [1, 2, 3, 4, 5]
    salt_a = make_namespace("m", cache_salt="a")
    _, blocks = _put(pool, cache, toks[:4], ns=salt_a)
    assert cache.match_prefix(make_namespace("m", cache_salt="b"), toks).num_tokens == 0
    assert cache.match_prefix(make_namespace("m"), toks).num_tokens == 0
    assert cache.match_prefix(make_namespace("other", cache_salt="a"), toks).num_tokens == 0
    assert cache.match_prefix(make_namespace("m", cache_salt="a"), toks).blocks == blocks
    # A salt equal to an adapter id does not reach that adapter's cache, nor back.
    adapter_x = make_namespace("m", adapter="x")
    _, ablocks = _put(pool, cache, toks[:4], ns=adapter_x)
    assert cache.match_prefix(make_namespace("m", cache_salt="x"), toks).num_tokens == 0
    assert cache.match_prefix(adapter_x, toks).blocks == ablocks
    _put(pool, cache, [7, 7], ns=make_namespace("m", cache_salt="y"))
    assert cache.match_prefix(make_namespace("m", adapter="y"), [7, 7]).num_tokens == 0
    # Requests without a salt share the default namespace.
    _, d = _put(pool, cache, [8, 8], ns=make_namespace("m"))
    assert cache.match_prefix(make_namespace("m", None, None), [8, 8, 0]).blocks == d
    cache.check_invariants()


def test_evict_lru_order() -> None:
    pool, cache = _cache(num_blocks=8, block_size=2)
    _, a = _put(pool, cache, [1, 1])
    _, b = _put(pool, cache, [2, 2])
    _, c = _put(pool, cache, [3, 3])
    cache.match_prefix(NS, [1, 1, 0])  # touch a: b is now the least recent
    assert pool.num_free == 5
    assert cache.evict(1) == 1
    assert cache.match_prefix(NS, [2, 2, 0]).num_tokens == 0
    assert pool.ref_counts[b[0]] == 0 and pool.num_free == 6
    assert cache.evict(1) == 1  # c (a was touched after c was inserted)
    assert cache.match_prefix(NS, [3, 3, 0]).num_tokens == 0
    assert cache.match_prefix(NS, [1, 1, 0]).blocks == a
    assert cache.evict(5) == 1 and cache.num_cached_blocks == 0 and pool.num_free == 8
    assert cache.root.children == {}  # the empty namespace root went too
    cache.check_invariants()


def test_evict_skips_locked_and_trims_tail() -> None:
    pool, cache = _cache(num_blocks=8, block_size=2)
    old, a = _put(pool, cache, [1, 1, 2, 2, 3, 3])
    new, b = _put(pool, cache, [4, 4, 5, 5])
    cache.lock(old)
    assert cache.evictable_blocks == 2 and cache.protected_blocks == 3
    assert cache.evict(1) == 1  # the newer, unlocked leaf loses its last block
    assert cache.match_prefix(NS, [4, 4, 5, 5, 0]).blocks == b[:1]
    assert cache.evict(10) == 1
    assert cache.match_prefix(NS, [1, 1, 2, 2, 3, 3]).blocks == a
    cache.unlock(old)
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert cache.evict(0) == 0
    assert cache.evict(3) == 3 and cache.num_cached_blocks == 0
    with pytest.raises(ValueError):
        cache.lock(old)  # evicted
    cache.check_invariants()


def test_parent_becomes_evictable_after_last_child() -> None:
    pool, cache = _cache(num_blocks=8, block_size=2)
    _, a = _put(pool, cache, [1, 1, 2, 2])
    _, b = _put(pool, cache, [1, 1, 3, 3])  # splits: parent [1,1] with children [2,2], [3,3]
    parent = cache.match_prefix(NS, [1, 1, 0]).node
    assert len(parent.children) == 2
    assert cache.evict(1) == 1 and len(parent.children) == 1  # a leaf, not the parent
    assert cache.match_prefix(NS, [1, 1, 0]).blocks == [a[0]]
    assert cache.evict(1) == 1 and not parent.children
    assert cache.match_prefix(NS, [1, 1, 0]).blocks == [a[0]]
    assert cache.evict(1) == 1  # now the parent itself is the leaf
    assert cache.num_cached_blocks == 0 and pool.num_free == 8
    cache.check_invariants()


def test_partial_block_match() -> None:
    pool, cache = _cache(block_size=4)
    _, blocks = _put(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    m = cache.match_prefix(NS, [1, 2, 3, 4, 5, 6, 9, 9, 9])
    assert m.blocks == blocks[:1] and m.num_tokens == 4
    assert m.partial is not None
    assert (m.partial.block_id, m.partial.num_tokens) == (blocks[1], 2)
    assert m.partial.node.blocks[0] == blocks[1]
    # Partial match of the first block, and the longest of several candidates wins.
    _, other = _put(pool, cache, [1, 2, 7, 7])
    m = cache.match_prefix(NS, [1, 2, 7, 0])
    assert m.num_tokens == 0 and (m.partial.block_id, m.partial.num_tokens) == (other[0], 3)
    assert cache.match_prefix(NS, [9, 2, 3]).partial is None
    # The cap limits the partial match too.
    m = cache.match_prefix(NS, [1, 2, 3, 4, 5, 6, 7], max_tokens=5)
    assert m.num_tokens == 4 and m.partial.num_tokens == 1
    assert cache.stats.partial_hit_tokens == 2 + 3 + 1
    cache.check_invariants()


def test_partial_match_touches_only_the_block_it_uses() -> None:
    """A partial match copies the first block of a cached run: only that block counts as used.
    The rest of the run ages as before, so a long prompt that others share a first token with
    is still evicted least recently used first (a fresh user's report: 'Document A: ...' stayed
    cached whole while B..G, which also start with 'Document', were evicted)."""
    pool, cache = _cache(num_blocks=16, block_size=2)
    _, a = _put(pool, cache, [1, 1, 2, 2, 3, 3, 4, 4])  # A: 4 blocks
    _, b = _put(pool, cache, [5, 5, 6, 6])  # B: newer than A
    m = cache.match_prefix(NS, [1, 9, 9])  # shares A's first token only
    assert m.num_tokens == 0 and (m.partial.block_id, m.partial.num_tokens) == (a[0], 1)
    assert m.partial.node.blocks == [a[0]]  # A's run split after the block used
    # Least recently used first: A's last three blocks (untouched since before B), then B.
    assert cache.evict(3) == 3
    assert cache.match_prefix(NS, [1, 1, 2, 2, 3, 3, 4, 4, 0]).blocks == a[:1]
    assert all(pool.ref_counts[x] == 1 for x in b)  # B still cached (checked without touching it)
    assert cache.evict(2) == 2  # B now: the copied block was used after B was cached
    assert all(pool.ref_counts[x] == 0 for x in b)
    assert cache.match_prefix(NS, [1, 1, 0]).blocks == a[:1]
    cache.check_invariants()


def test_fully_cached_prompt_leaves_last_token() -> None:
    pool, cache = _cache(block_size=4)
    prompt = list(range(12))
    _, blocks = _put(pool, cache, prompt)
    m = cache.match_prefix(NS, prompt, max_tokens=len(prompt) - 1)
    assert m.blocks == blocks[:2] and m.num_tokens == 8
    assert m.partial is not None and (m.partial.block_id, m.partial.num_tokens) == (blocks[2], 3)
    assert m.num_tokens + m.partial.num_tokens == len(prompt) - 1
    # Without a cap the whole prompt would match.
    assert cache.match_prefix(NS, prompt).num_tokens == 12
    assert cache.stats.query_tokens == 11 + 12 and cache.stats.hit_tokens == 8 + 12
    cache.check_invariants()


def test_insert_duplicate_is_not_adopted_and_returns_deepest_node() -> None:
    pool, cache = _cache(num_blocks=16, block_size=2)
    toks = [1, 2, 3, 4, 5, 6]
    first = pool.allocate(3)
    second = pool.allocate(3)  # a second request computed the same prefix in the same step
    n1 = cache.insert(NS, toks, first)
    n2 = cache.insert(NS, toks, second)
    assert n1 is n2 and _depth_blocks(n1) == 3
    assert [pool.ref_counts[b] for b in first] == [2, 2, 2]
    assert [pool.ref_counts[b] for b in second] == [1, 1, 1]
    pool.decref(second)
    pool.decref(first)
    assert cache.match_prefix(NS, toks + [0]).blocks == first
    # Growing prefix (chunked prefill): each call returns the node ending at its length.
    blocks = pool.allocate(4)
    grow = [9, 9, 8, 8, 7, 7, 6, 6]
    for k in range(1, 5):
        node = cache.insert(NS, grow[: 2 * k], blocks[:k])
        assert _depth_blocks(node) == k
    # Inserting a shorter prefix than cached splits and returns the exact node.
    node = cache.insert(NS, grow[:2], blocks[:1])
    assert node.tokens == (9, 9) and _depth_blocks(node) == 1
    pool.decref(blocks)
    assert cache.num_cached_blocks == 7
    cache.check_invariants()


def test_insert_errors() -> None:
    pool, cache = _cache(num_blocks=8, block_size=2)
    b = pool.allocate(2)
    with pytest.raises(ValueError):
        cache.insert(NS, [1, 2, 3], b[:1])
    with pytest.raises(ValueError):
        cache.insert(NS, [1, 2], [7])  # free block
    with pytest.raises(ValueError):
        cache.insert(NS, [1, 2], [99])
    with pytest.raises(ValueError):
        cache.insert(NS, [1, 2, 3, 4], [b[0], b[0]])
    cache.insert(NS, [1, 2], b[:1])
    with pytest.raises(ValueError):
        cache.insert(NS, [5, 6], b[:1])  # already cached under other tokens
    assert cache.insert(NS, [], []) is cache.root.children[NS]
    cache.check_invariants()


def test_unlock_requires_lock_and_root_lockable() -> None:
    pool, cache = _cache()
    m = cache.match_prefix(NS, [1, 2, 3, 4, 5])
    cache.lock(m.node)  # the tree root when the namespace is unknown
    cache.unlock(m.node)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)


def test_insert_from_start_node_and_move_lock() -> None:
    pool, cache = _cache(num_blocks=16, block_size=2)
    toks = [1, 1, 2, 2, 3, 3, 4, 4]
    blocks = pool.allocate(4)
    m = cache.match_prefix(NS, toks, max_tokens=len(toks) - 1)
    cache.lock(m.node)  # the tree root: nothing cached yet
    node = m.node
    for k in (1, 3, 4):  # chunked prefill: the cached prefix grows
        new = cache.insert(NS, toks[: 2 * k], blocks[:k], start=node)
        assert new.depth == 2 * k and _depth_blocks(new) == k
        cache.move_lock(node, new)
        node = new
        cache.check_invariants()
        assert cache.protected_blocks == k and cache.evictable_blocks == 0
        assert cache.root.lock_ref == 1
    # Another request splits the locked path; the lower node keeps its depth and lock.
    other, ob = _put(pool, cache, [1, 1, 2, 2, 9, 9])
    assert node.depth == 8 and cache.protected_blocks == 4
    assert cache.match_prefix(NS, toks).blocks == blocks
    # move_lock across branches: only the nodes below the common ancestor change.
    cache.move_lock(node, other)
    assert node.lock_ref == 0 and other.lock_ref == 1 and cache.root.lock_ref == 1
    assert cache.protected_blocks == 3 and cache.evictable_blocks == 2
    cache.check_invariants()
    with pytest.raises(ValueError):  # start does not spell these tokens
        cache.insert(NS, [5, 5, 5, 5, 5, 5, 5, 5], pool.allocate(4), start=node)
    with pytest.raises(ValueError):  # start of another namespace
        cache.insert(make_namespace("m", cache_salt="s"), toks, blocks, start=node)
    with pytest.raises(RuntimeError):
        cache.move_lock(node, other)  # node is not locked
    cache.unlock(other)
    pool.decref(blocks)
    assert cache.evict(100) == 5 and cache.root.children == {}
    cache.check_invariants()


def test_ancestor_at_splits_the_spanning_node() -> None:
    pool, cache = _cache(num_blocks=16, block_size=2)
    node, blocks = _put(pool, cache, [1, 1, 2, 2, 3, 3, 4, 4])
    cache.lock(node)
    top = cache.ancestor_at(node, 4)
    assert top.depth == 4 and top.blocks == blocks[:2] and node.parent is top and top.lock_ref == 1
    assert cache.ancestor_at(node, 4) is top and cache.ancestor_at(node, 8) is node
    assert cache.ancestor_at(node, 0) is cache.root.children[NS]
    assert cache.ancestor_at(cache.root, 0) is cache.root
    for bad in (3, 10, -2):
        with pytest.raises(ValueError):
            cache.ancestor_at(node, bad)
    cache.lock(top)
    cache.unlock(node)
    assert cache.evict(10) == 2 and cache.protected_blocks == 2  # node's own blocks went
    cache.check_invariants()


def test_many_leaves_evict_fast() -> None:
    pool, cache = _cache(num_blocks=4096, block_size=1)
    for i in range(4000):
        _put(pool, cache, [i])
    assert cache.evict(4000) == 4000 and pool.num_free == 4096


# ----------------------------------------------------------------------------- stateful test
NAMESPACES = [
    make_namespace("m"),
    make_namespace("m", cache_salt="x"),
    make_namespace("m", adapter="x"),
]


@dataclass
class Req:
    ns: tuple
    tokens: list[int]
    table: list[int]
    computed: int
    node: RadixNode
    full_done: int = 0  # full blocks whose content is set
    fast: bool = False  # insert(start=...) + move_lock, or the plain calls


class RadixMachine(RuleBasedStateMachine):
    """Drive BlockPool + RadixCache as the engine would and check them against a model.

    Model: ``self.model`` maps ``(namespace, prefix tokens)`` of every cached full block to
    its block id; ``self.content[b]`` is what a block's K/V "contains": the namespace and
    the whole prefix up to the end of that block (K/V depend on all earlier tokens).
    """

    @initialize(
        block_size=st.sampled_from([1, 2, 3]),
        num_blocks=st.integers(4, 24),
    )
    def setup(self, block_size: int, num_blocks: int) -> None:
        self.bs = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple, int] = {}
        self.content: dict[int, Optional[tuple]] = {}
        self.reqs: list[Req] = []
        self.prompts: list[list[int]] = [[0]]

    # ---------------------------------------------------------------- helpers
    def expected_match(self, ns: tuple, q: list[int]) -> tuple[list[int], int]:
        bs, blocks, k = self.bs, [], 0
        while (k + 1) * bs <= len(q) and (ns, tuple(q[: (k + 1) * bs])) in self.model:
            blocks.append(self.model[(ns, tuple(q[: (k + 1) * bs]))])
            k += 1
        m, best = min(bs - 1, len(q) - k * bs), 0
        head, tail = tuple(q[: k * bs]), q[k * bs : k * bs + max(m, 0)]
        for (ns2, p), _ in self.model.items():
            if ns2 != ns or len(p) != (k + 1) * bs or p[: k * bs] != head:
                continue
            n = 0
            while n < m and p[k * bs + n] == tail[n]:
                n += 1
            best = max(best, n)
        return blocks, best

    def check_match(self, ns: tuple, tokens: list[int], cap: int):
        q = tokens[:cap]
        want_blocks, want_partial = self.expected_match(ns, q)
        m = self.cache.match_prefix(ns, tokens, max_tokens=cap)
        assert m.blocks == want_blocks
        assert m.num_tokens == len(want_blocks) * self.bs <= len(q)
        for j, b in enumerate(m.blocks):
            assert self.content[b] == (ns, tuple(q[: (j + 1) * self.bs]))
        assert _depth_blocks(m.node) == len(m.blocks)
        assert m.node is self.cache.root or m.node.namespace == ns
        if want_partial == 0:
            assert m.partial is None
        else:
            assert m.partial is not None and m.partial.num_tokens == want_partial
            end = m.num_tokens + want_partial
            src_ns, src_prefix = self.content[m.partial.block_id]
            assert src_ns == ns and src_prefix[:end] == tuple(q[:end])
            assert len(src_prefix) == m.num_tokens + self.bs
            assert m.partial.node.blocks[0] == m.partial.block_id
        return m

    def ensure_free(self, n: int) -> bool:
        if self.pool.num_free < n:
            before_free, before_ev = self.pool.num_free, self.cache.evictable_blocks
            want = n - self.pool.num_free
            freed = self.cache.evict(want)
            assert freed == min(want, before_ev)
            assert self.pool.num_free == before_free + freed
            self.resync_model_after_evict(freed)
        return self.pool.num_free >= n

    def tree_model(self) -> dict[tuple, int]:
        out: dict[tuple, int] = {}
        for ns, ns_root in self.cache.root.children.items():
            stack = [(ns_root, ())]
            while stack:
                node, prefix = stack.pop()
                for j, b in enumerate(node.blocks):
                    out[(ns, prefix + node.tokens[: (j + 1) * self.bs])] = b
                for child in node.children.values():
                    stack.append((child, prefix + node.tokens))
        return out

    def resync_model_after_evict(self, freed: int) -> None:
        tree = self.tree_model()
        removed = set(self.model) - set(tree)
        assert set(tree) <= set(self.model)
        assert all(self.model[k] == b for k, b in tree.items())
        assert len(removed) == freed
        for key in removed:
            assert self.pool.ref_counts[self.model[key]] == 0
        self.model = tree

    def compute_to(self, r: Req, n: int) -> None:
        """Compute ``n`` more tokens of ``r`` and cache its full blocks (after a step)."""
        r.computed = min(len(r.tokens), r.computed + n)
        full = r.computed // self.bs
        for j in range(r.full_done, full):
            self.content[r.table[j]] = (r.ns, tuple(r.tokens[: (j + 1) * self.bs]))
        r.full_done = max(r.full_done, full)
        self.insert_full(r)

    def insert_full(self, r: Req) -> None:
        full = r.computed // self.bs
        tokens, blocks = r.tokens[: full * self.bs], r.table[:full]
        if r.fast:
            node = self.cache.insert(r.ns, tokens, blocks, start=r.node)
        else:
            node = self.cache.insert(r.ns, tokens, blocks)
        assert _depth_blocks(node) == full == node.depth // self.bs
        for j in range(full):
            key = (r.ns, tuple(r.tokens[: (j + 1) * self.bs]))
            self.model.setdefault(key, r.table[j])
        if r.fast:
            self.cache.move_lock(r.node, node)
        else:
            self.cache.lock(node)
            self.cache.unlock(r.node)
        r.node = node

    def pick(self, i: int) -> Optional[Req]:
        return self.reqs[i % len(self.reqs)] if self.reqs else None

    # ---------------------------------------------------------------- rules
    @rule(
        ns=st.sampled_from(NAMESPACES),
        base=st.integers(0, 100),
        cut=st.integers(0, 12),
        suffix=st.lists(st.integers(0, 2), max_size=6),
        chunk=st.integers(0, 12),
        fast=st.booleans(),
    )
    def admit(self, ns, base, cut, suffix, chunk, fast) -> None:
        tokens = self.prompts[base % len(self.prompts)][:cut] + suffix
        if not tokens:
            return
        self.prompts.append(tokens)
        m = self.check_match(ns, tokens, len(tokens) - 1)
        self.cache.lock(m.node)
        self.pool.incref(m.blocks)
        if m.partial is not None:
            self.cache.lock(m.partial.node)  # keep the copy source until the copy ran
        need = -(-len(tokens) // self.bs) - len(m.blocks)
        if not self.ensure_free(need):  # not admitted: roll back
            if m.partial is not None:
                self.cache.unlock(m.partial.node)
            self.cache.unlock(m.node)
            self.pool.decref(m.blocks)
            return
        new = self.pool.allocate(need)
        for b in new:
            self.content[b] = None
        r = Req(ns, tokens, m.blocks + new, m.num_tokens, m.node, len(m.blocks), fast)
        if m.partial is not None:  # the engine copies K/V of the partial block here
            src = m.partial.block_id
            assert self.pool.ref_counts[src] > 0 and self.cache.is_cached(src)
            assert self.content[src][1][: r.computed + m.partial.num_tokens] == tuple(
                tokens[: r.computed + m.partial.num_tokens]
            )
            r.computed += m.partial.num_tokens
            self.cache.unlock(m.partial.node)
        assert r.computed < len(tokens)
        self.reqs.append(r)
        self.compute_to(r, chunk)

    @rule(i=st.integers(0, 50), n=st.integers(1, 8))
    def step(self, i, n) -> None:
        r = self.pick(i)
        if r is not None:
            self.compute_to(r, n)

    @rule(i=st.integers(0, 50), tok=st.integers(0, 2))
    def decode(self, i, tok) -> None:
        r = self.pick(i)
        if r is None or r.computed < len(r.tokens):
            return
        if len(r.tokens) + 1 > len(r.table) * self.bs:
            if not self.ensure_free(1):
                return
            new = self.pool.allocate(1)
            self.content[new[0]] = None
            r.table += new
        r.tokens.append(tok)
        self.compute_to(r, 1)

    @rule(i=st.integers(0, 50))
    def finish(self, i) -> None:
        r = self.pick(i)
        if r is None:
            return
        self.insert_full(r)
        self.cache.unlock(r.node)
        self.pool.decref(r.table)
        self.reqs.remove(r)

    @rule(i=st.integers(0, 50))
    def preempt(self, i) -> None:
        r = self.pick(i)
        if r is None:
            return
        self.cache.unlock(r.node)
        self.pool.decref(r.table)
        self.reqs.remove(r)

    @rule(n=st.integers(0, 10))
    def evict(self, n) -> None:
        before = self.cache.evictable_blocks
        freed = self.cache.evict(n)
        assert freed == min(n, before)
        self.resync_model_after_evict(freed)

    @rule(ns=st.sampled_from(NAMESPACES), base=st.integers(0, 100), extra=st.integers(0, 3))
    def query(self, ns, base, extra) -> None:
        tokens = self.prompts[base % len(self.prompts)] + [0] * extra
        self.check_match(ns, tokens, len(tokens) - extra)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def pool_and_tree_agree(self) -> None:
        pool, cache = self.pool, self.cache
        cache.check_invariants()
        assert self.tree_model() == self.model
        tree_blocks = set(self.model.values())
        expected = [1 if b in tree_blocks else 0 for b in range(pool.num_blocks)]
        for r in self.reqs:
            for b in r.table:
                expected[b] += 1
        assert pool.ref_counts == expected
        free = list(pool._free)
        assert len(free) == len(set(free))
        assert set(free) == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
        unlocked = [b for n in cache.iter_nodes() if n.lock_ref == 0 for b in n.blocks]
        assert all(pool.ref_counts[b] == 1 for b in unlocked)  # held by the tree alone
        evictable = len(unlocked)
        assert cache.evictable_blocks == evictable
        assert cache.protected_blocks == len(tree_blocks) - evictable
        in_use = sum(1 for c in pool.ref_counts if c > 0) - evictable
        assert pool.num_free + evictable + in_use == pool.num_blocks

    @invariant()
    def locks_follow_requests(self) -> None:
        expected: dict[int, int] = {}
        for r in self.reqs:
            node = r.node
            assert node.parent is not None or node is self.cache.root
            while node is not None:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        assert self.cache.root.lock_ref == len(self.reqs)
        for node in self.cache.iter_nodes():
            assert node.lock_ref == expected.get(id(node), 0)
            assert node.parent.lock_ref >= node.lock_ref


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
