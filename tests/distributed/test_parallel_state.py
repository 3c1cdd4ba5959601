"""kvserve.distributed: the process-group state, the collectives (no-ops at world size 1, gloo
across spawned ranks), the head split, and ranks that never outlive a failure."""

import time

import pytest
import torch

from kvserve.distributed import (broadcast_object, get_tp_rank, get_tp_world_size, init_distributed, is_initialized,
                                 tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce,
                                 tensor_model_parallel_gather, tp_head_counts)
from kvserve.distributed.parallel_state import default_backend_for, destroy_distributed


def test_world_size_one_is_the_default_and_every_collective_a_no_op():
    assert (get_tp_rank(), get_tp_world_size(), is_initialized()) == (0, 1, False)
    x = torch.randn(3, 4)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x
    assert tensor_model_parallel_gather(x) is x
    obj = {"a": [1, 2]}
    assert broadcast_object(obj) is obj
    # one rank: the state is set, no process group is started
    assert init_distributed(1, 0, "file:///nonexistent") == torch.device("cpu")
    assert not torch.distributed.is_initialized() and get_tp_world_size() == 1
    destroy_distributed()


def test_backend_follows_the_device():
    assert default_backend_for("cpu") == "gloo"
    assert default_backend_for(torch.device("cuda", 1)) == "nccl"


def test_bad_rank_or_world_size():
    with pytest.raises(ValueError, match="rank"):
        init_distributed(2, 2, "file:///nonexistent")
    with pytest.raises(ValueError, match="world_size"):
        init_distributed(0, 0, "file:///nonexistent")


@pytest.mark.parametrize("heads, kv, tp, expect", [
    (9, 3, 1, (9, 3, 1)), (9, 3, 3, (3, 1, 1)),  # SmolLM2
    (4, 2, 2, (2, 1, 1)), (4, 2, 4, (1, 1, 2)),  # KV heads replicated past num_kv_heads
    (4, 1, 2, (2, 1, 2)), (32, 8, 16, (2, 1, 2)), (32, 8, 4, (8, 2, 1)),
])
def test_head_counts_per_rank(heads, kv, tp, expect):
    assert tp_head_counts(heads, kv, tp) == expect


@pytest.mark.parametrize("heads, kv, tp, match", [
    (9, 3, 2, "tensor_parallel_size=2 does not divide the model's 9 attention heads"),
    (12, 3, 2, "tensor_parallel_size=2 does not divide the model's 3 KV heads"),
    (12, 4, 6, "tensor_parallel_size=6 is neither a divisor nor a multiple of the model's 4 KV heads"),
    (8, 8, 0, "tensor_parallel_size must be >= 1"),
])
def test_head_counts_errors_name_the_sizes(heads, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        tp_head_counts(heads, kv, tp)


# ------------------------------------------------------------------ across ranks (rank jobs)

def _collectives():
    rank, ws = get_tp_rank(), get_tp_world_size()
    x = torch.full((2, 3), float(rank + 1))
    y = tensor_model_parallel_all_reduce(x)
    bf = tensor_model_parallel_all_reduce(torch.full((4,), 0.5 * (rank + 1), dtype=torch.bfloat16))
    g = tensor_model_parallel_all_gather(torch.full((2, 1), float(rank)), dim=-1)
    g0 = tensor_model_parallel_gather(torch.full((1, 2), float(rank)), dst=0, dim=0)
    obj = broadcast_object({"from": rank, "ids": [rank] * 3} if rank == 1 else None, src=1)
    return dict(rank=rank, ws=ws, same=y is x, y=y, bf=bf, g=g, g0=g0, obj=obj)


def test_collectives_across_two_ranks(tp_pool):
    res = tp_pool(2).run(_collectives)
    for r, out in enumerate(res):
        assert (out["rank"], out["ws"], out["same"]) == (r, 2, True)  # all-reduce is in place
        assert torch.equal(out["y"], torch.full((2, 3), 3.0))
        assert out["bf"].dtype == torch.bfloat16 and torch.equal(out["bf"].float(), torch.full((4,), 1.5))
        assert torch.equal(out["g"], torch.tensor([[0.0, 1.0], [0.0, 1.0]]))  # rank order along dim
        assert out["obj"] == {"from": 1, "ids": [1, 1, 1]}
    assert torch.equal(res[0]["g0"], torch.tensor([[0.0, 0.0], [1.0, 1.0]])) and res[1]["g0"] is None


def _fail_on_rank_one():
    if get_tp_rank() == 1:
        raise RuntimeError("rank 1 fails before the all-reduce")
    return tensor_model_parallel_all_reduce(torch.ones(3))  # rank 0 waits for rank 1 here


def test_a_failing_rank_ends_every_rank():
    from tp_harness import RankError, RankPool

    pool = RankPool(2)
    try:
        procs = list(pool.procs)
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1 fails before the all-reduce"):
            pool.run(_fail_on_rank_one, timeout_s=60)
        assert time.monotonic() - t0 < 10  # not the collective's 60 s timeout
        assert not pool.alive and all(p.exitcode is not None for p in procs)  # killed and reaped
    finally:
        pool.close(kill=True)
