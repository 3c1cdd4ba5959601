"""The replicas' router (kvserve.engine.router): the approximate radix tree of each replica,
prefix routing with its load threshold and cache threshold, least_loaded and round_robin."""

import random

import pytest

from kvserve.engine.ray_serve import replica_specs
from kvserve.engine.router import PrefixTree, Router, block_hashes


def test_block_hashes_are_a_chain_over_full_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the last 8 tokens fill no block
    b = block_hashes(list(range(32)) + [7] * 8, 16)
    assert a == b
    c = block_hashes([99] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later node (a path, not a set)
    d = block_hashes(list(range(16)) + [5] + list(range(17, 40)), 16)
    assert d[0] == a[0] and d[1] != a[1]


def test_prefix_tree_matches_leading_blocks_and_evicts_lru():
    t = PrefixTree(max_blocks=4)
    p = block_hashes(list(range(64)), 16)  # 4 blocks
    t.insert(p)
    assert t.match(p) == 4 and t.match(p[:2]) == 2
    q = block_hashes([1000 + i for i in range(32)], 16)
    t.insert(q)  # 6 nodes > 4: p's two least recently used (its first two) go
    assert len(t) == 4 and t.match(q) == 2
    assert t.match(p) == 0  # its root block is gone: nothing of the path matches
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixTree(0)


def _prompt(rng, prefix, n=8):
    return prefix + [rng.randrange(50_000) for _ in range(n)]


def test_prefix_routing_keeps_each_group_on_one_replica_and_spreads_the_groups():
    rng = random.Random(0)
    r = Router(["a", "b"], "prefix", block_size=16)
    prefixes = [[rng.randrange(50_000) for _ in range(1000)] for _ in range(8)]
    chosen = {}
    for g, prefix in enumerate(prefixes):
        for _ in range(8):
            ids = _prompt(rng, prefix)
            name = r.choose(ids)
            r.started(name, ids)
            chosen.setdefault(g, set()).add(name)
        for name in chosen[g]:  # the group's requests finish
            for _ in range(8):
                r.finished(name)
    assert all(len(v) == 1 for v in chosen.values())  # each prefix on one replica only
    per = [sum(1 for v in chosen.values() if v == {n}) for n in ("a", "b")]
    assert per == [4, 4]  # new prefixes go to the replica with the smaller tree
    assert r.routed == {"a": 32, "b": 32} and r.load == {"a": 0, "b": 0}


def test_one_hot_prefix_cannot_pin_one_replica():
    rng = random.Random(1)
    r = Router(["a", "b"], "prefix", block_size=16, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prefix = [rng.randrange(50_000) for _ in range(512)]
    for _ in range(40):  # all in flight at once: none finishes
        ids = _prompt(rng, prefix)
        r.started(r.choose(ids), ids)
    # the load gap never exceeds the threshold by more than one request
    assert abs(r.load["a"] - r.load["b"]) <= 5
    assert min(r.load.values()) >= 15


def test_a_short_match_does_not_count():
    r = Router(["a", "b"], "prefix", block_size=16, cache_threshold=0.5)
    shared = list(range(32))  # 2 blocks
    first = shared + list(range(100, 164))  # 6 blocks
    r.started(r.choose(first), first)  # -> a (both empty)
    other = shared + list(range(500, 564))  # shares 2 of 6 blocks with it: below 0.5
    assert r.choose(other) == "b"  # the smaller tree
    same = first[:80] + [1, 2, 3]
    assert r.choose(same) == "a"  # 5 of 5 blocks


def test_least_loaded_and_round_robin():
    r = Router(["a", "b", "c"], "least_loaded")
    r.load.update(a=3, b=1, c=2)
    assert r.choose([1, 2, 3]) == "b"
    assert r.choose([1, 2, 3], healthy=["a", "c"]) == "c"
    assert r.choose([1], exclude=["b"]) == "c"
    r.load.update(a=0, b=0, c=0)
    assert sorted(r.choose([1]) for _ in range(3)) == ["a", "b", "c"]  # equals take turns
    rr = Router(["a", "b", "c"], "round_robin")
    assert [rr.choose([1]) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert [rr.choose([1], healthy=["a", "c"]) for _ in range(4)] == ["a", "c", "a", "c"]
    with pytest.raises(LookupError):
        rr.choose([1], healthy=[])
    assert rr.choose([1], healthy=["b"], exclude=["b"]) == "b"  # the only one left


def test_forget_and_finished_never_go_negative():
    r = Router(["a"], "prefix")
    ids = list(range(64))
    r.started("a", ids)
    r.forget("a")
    assert r.load["a"] == 0 and len(r.trees["a"]) == 0
    r.finished("a")
    assert r.load["a"] == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="random"), "routing must be one of"),
    (dict(block_size=0), "block_size"),
    (dict(balance_rel_threshold=0.5), "balance_rel_threshold"),
    (dict(cache_threshold=1.5), "cache_threshold"),
])
def test_router_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Router(["a"], **kwargs)
    with pytest.raises(ValueError, match="at least one replica"):
        Router([])


def test_replica_specs():
    assert [s.name for s in replica_specs(3)] == ["replica-0", "replica-1", "replica-2"]
    specs = replica_specs(1, 1, 2, app_prefix="x")
    assert [(s.name, s.role, s.app_name) for s in specs] == [
        ("prefill-0", "prefill", "x-prefill-0"), ("decode-0", "decode", "x-decode-0"), ("decode-1", "decode", "x-decode-1")]
    dp_range = r"--data-parallel-size must be an integer ≥ 1 \(1: one engine, no replicas\), got "
    for args, match in [((0,), dp_range + "0"), ((-1,), dp_range + "-1"), ((1.5,), dp_range + "1.5"),
                        ((2, 1, 1), "either --data-parallel-size"), ((1, 1, 0), "must both be ≥ 1"),
                        ((1, -1, 1), r"--prefill-replicas must be an integer ≥ 0 \(0: no prefill/decode")]:
        with pytest.raises(ValueError, match=match):
            replica_specs(*args)


def test_replicas_that_do_not_fit_the_ray_cluster_are_refused_naming_the_cpus():
    """``check_replica_cpus`` on a fake cluster's ``(cluster_resources, available_resources)``
    CPUs: replicas × ``--replica-cpus`` above the cluster's CPUs (Ray Serve would wait for
    them forever), or above its free ones, fail naming the option and both numbers."""
    from kvserve.engine.ray_serve import check_replica_cpus

    pd = replica_specs(1, 1, 2)
    with pytest.raises(ValueError) as e:
        check_replica_cpus(4, pd, (8.0, 8.0))
    assert str(e.value).startswith("3 replicas (1 prefill + 2 decode) of --replica-cpus 4 need 12 Ray CPUs, "
                                   "but the Ray cluster has 8 CPUs (ray.cluster_resources())")
    with pytest.raises(ValueError, match=r"^2 replicas of --replica-cpus 1.5 need 3 Ray CPUs, but only 2 of the Ray "
                                         r"cluster's 4 CPUs are free"):
        check_replica_cpus(1.5, replica_specs(2), (4.0, 2.0))
    check_replica_cpus(2, replica_specs(2), (4.0, 4.0))  # exactly fits
    check_replica_cpus(0.5, pd, (1.5, 1.5))


def test_replica_threads_follow_replica_cpus_when_given():
    """--replica-cpus sets the torch threads too, as its help says, also on a local Ray instance
    (there it was always the machine's cores shared out, whatever the option said)."""
    from kvserve.engine.ray_serve import replica_threads

    assert replica_threads(None, 16, 2, local=True) == 8  # the cores shared out
    assert replica_threads(None, 2, 3, local=True) == 1
    assert replica_threads(None, 16, 2, local=False) == 1  # a cluster's default: 1 Ray CPU each
    assert replica_threads(4, 16, 2, local=True) == 4  # given: followed, locally too
    assert replica_threads(2.5, 16, 2, local=False) == 2
    assert replica_threads(0.5, 16, 2, local=True) == 1  # at least one thread


def test_prompts_shorter_than_a_block_go_to_the_least_loaded_replica():
    """No full block to hash: neither a match nor a tree to grow, so the load decides. (They
    went to the replica with the smallest tree: every short prompt to the same one, here ``a``,
    until the balance threshold.)"""
    r = Router(["a", "b", "c"], "prefix", block_size=16)
    for name, n in (("b", 2), ("c", 1)):  # earlier long prompts, finished: b's and c's trees are larger
        ids = list(range(1000 * n, 1000 * n + 16 * n))
        r.started(name, ids)
        r.finished(name)
    assert [len(r.trees[n]) for n in "abc"] == [0, 2, 1]
    for i in range(6):  # in flight together
        ids = [7, i, 9]
        r.started(r.choose(ids), ids)
    assert r.load == {"a": 2, "b": 2, "c": 2}
    r.load.update(a=5, b=3, c=4)
    assert r.choose([1, 2, 3]) == "b"
    assert r.choose(list(range(15))) == "b"  # 15 tokens: still no full block
    assert r.choose(list(range(16))) == "a"  # a full block: the smallest tree again
