"""Routing requests between engine replicas: ``round_robin``, ``least_loaded`` and ``prefix``.

The front end routes every request itself (:class:`~kvserve.entrypoints.openai.replica_engine.ReplicatedAsyncEngine`),
knowing each replica's load exactly: its requests in flight (running plus waiting, as the
replica's scheduler holds them; a request of ``n`` samples counts once).

``prefix`` follows SGLang's cache-aware router (sgl-router, ``cache_aware``): the router keeps,
per replica, an approximate radix tree of the prompts it sent there, and sends a request to
the replica whose tree shares the longest prefix with its prompt: the replica most likely to
serve that prefix from its own prefix cache. The tree is approximate: it records what was
routed, not what the replica's cache holds now (the replica may have evicted it), and it
forgets the least recently used blocks beyond ``max_blocks`` per replica. Two rules keep the
load even:

* **balance first**: when the busiest replica has more than ``balance_abs_threshold``
  requests in flight above the idlest one and more than ``balance_rel_threshold`` times as
  many, the request goes to the least loaded replica, whatever its prefix, so that one hot
  prefix cannot pin one replica;
* **cache threshold**: a match shorter than ``cache_threshold`` of the prompt does not count;
  the request goes to the replica with the smallest tree (the most room for a new prefix),
  the least loaded among equals;
* **short prompts**: a prompt shorter than one block has no block to match or to record: it
  goes to the least loaded replica (as SGLang's router falls back to the shortest queue).

Trees are kept at block granularity (``block_size`` tokens, the engines' KV block size): a
node is a block's chain hash (the hash of the block's tokens and its parent's hash), so a
dictionary lookup per block walks the radix tree, and two prompts share a node exactly when
they share every token up to the end of that block.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Optional, Sequence

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hash of each full block of ``token_ids``: ``h[i] = hash((h[i-1], block i))``.

    Returns:
        ``len(token_ids) // block_size`` ints.
    """
    out, h = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start: start + block_size])))
        out.append(h)
    return out


class PrefixTree:
    """One replica's approximate radix tree of routed prompts, at block granularity, with LRU
    eviction beyond ``max_blocks`` nodes.

    Args:
        max_blocks: nodes kept (≥ 1); the least recently matched or inserted go first.
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be ≥ 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._nodes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, hashes: Sequence[int]) -> int:
        """Blocks of the prefix ``hashes`` that the tree holds (leading ones, in order)."""
        n = 0
        for h in hashes:
            if h not in self._nodes:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Record a routed prompt's blocks (marking them the most recently used)."""
        nodes = self._nodes
        for h in hashes:
            if h in nodes:
                nodes.move_to_end(h)
            else:
                nodes[h] = None
        while len(nodes) > self.max_blocks:
            nodes.popitem(last=False)

    def clear(self) -> None:
        self._nodes.clear()


class Router:
    """Picks a replica for each request and keeps the load counts.

    Args:
        replicas: the replicas' names.
        policy: one of :data:`ROUTING_POLICIES`.
        block_size: tokens per tree node (the engines' KV block size).
        max_blocks: nodes per replica's tree (about the replica's KV cache, in blocks).
        balance_abs_threshold, balance_rel_threshold, cache_threshold: ``prefix``'s rules (see
            the module docstring; SGLang's router defaults are 32, 1.0001 and 0.5: these default to
            16, 1.5 and 0.5, for engines of fewer sequence slots).

    Raises:
        ValueError: naming the field: an unknown policy, no replica, or a value out of range.
    """

    def __init__(self, replicas: Sequence[str], policy: str = "prefix", block_size: int = 16,
                 max_blocks: int = 65536, balance_abs_threshold: int = 16, balance_rel_threshold: float = 1.5,
                 cache_threshold: float = 0.5) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {list(ROUTING_POLICIES)}, got {policy!r}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be ≥ 0 and balance_rel_threshold ≥ 1, got "
                             f"{balance_abs_threshold} and {balance_rel_threshold}")
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.replicas = list(replicas)
        self.policy = policy
        self.block_size = block_size
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.load = {r: 0 for r in self.replicas}  # requests in flight
        self.routed = {r: 0 for r in self.replicas}  # requests sent, ever
        self.trees = {r: PrefixTree(max_blocks) for r in self.replicas}
        self._rr = itertools.cycle(range(len(self.replicas)))

    def choose(self, token_ids: Sequence[int], healthy: Optional[Sequence[str]] = None,
               exclude: Sequence[str] = ()) -> str:
        """The replica for a prompt (not yet counted: call :meth:`started`).

        Args:
            token_ids: the prompt.
            healthy: the replicas that may take it (default: all).
            exclude: replicas not to use (e.g. the one a retried request failed on), unless
                no other is healthy.

        Raises:
            LookupError: no replica is healthy.
        """
        pool = [r for r in (self.replicas if healthy is None else healthy) if r in self.load]
        if not pool:
            raise LookupError("no replica is available")
        pool = [r for r in pool if r not in exclude] or pool
        if self.policy == "round_robin":
            for _ in range(len(self.replicas)):
                r = self.replicas[next(self._rr)]
                if r in pool:
                    return r
        if self.policy == "least_loaded":
            return self._least_loaded(pool)
        return self._by_prefix(token_ids, pool)

    def _least_loaded(self, pool: list[str]) -> str:
        low = min(self.load[r] for r in pool)
        ties = [r for r in pool if self.load[r] == low]
        if len(ties) == 1:
            return ties[0]
        for _ in range(len(self.replicas)):  # equals take turns
            r = self.replicas[next(self._rr)]
            if r in ties:
                return r
        return ties[0]

    def _by_prefix(self, token_ids: Sequence[int], pool: list[str]) -> str:
        loads = [self.load[r] for r in pool]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return self._least_loaded(pool)
        hashes = block_hashes(token_ids, self.block_size)
        if not hashes:  # shorter than a block: no prefix to match or to record
            return self._least_loaded(pool)
        matches = {r: self.trees[r].match(hashes) for r in pool}
        best = max(pool, key=lambda r: (matches[r], -self.load[r]))
        if matches[best] and matches[best] >= self.cache_threshold * len(hashes):
            return best
        smallest = min(len(self.trees[r]) for r in pool)
        return self._least_loaded([r for r in pool if len(self.trees[r]) == smallest])

    def started(self, replica: str, token_ids: Sequence[int]) -> None:
        """Count a request sent to ``replica`` and record its prompt in that replica's tree."""
        self.load[replica] += 1
        self.routed[replica] += 1
        if self.policy == "prefix":
            self.trees[replica].insert(block_hashes(token_ids, self.block_size))

    def finished(self, replica: str) -> None:
        """A request of ``replica`` ended (finished, failed or aborted)."""
        if self.load.get(replica, 0) > 0:
            self.load[replica] -= 1

    def forget(self, replica: str) -> None:
        """``replica`` restarted with an empty cache: drop its tree (its requests ended with it)."""
        self.trees[replica].clear()
        self.load[replica] = 0
