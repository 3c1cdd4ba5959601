"""kvserve.roofline: the workload floor and the sustained matmul rate quoted by benchmarks/throughput.py."""

import pytest

from kvserve.roofline import attainable_seconds


def test_memory_bound_decode_steps():
    # prefill: 2·10·(2 + 4) / 20 = 6 s; decode steps s = 1, 2 run only the second request
    # (output 3): (100 weight bytes + (4 + s) KV bytes) / 10 B/s = 10.5 s and 10.6 s, above
    # its 2·10 / 20 = 1 s of compute.
    f = attainable_seconds([2, 4], [1, 3], params=10, weight_bytes=100, kv_bytes_per_token=1, flops=20,
                           bandwidth=10)
    assert f["prefill_s"] == pytest.approx(6.0)
    assert f["decode_s"] == pytest.approx(21.1)
    assert f["total_s"] == pytest.approx(27.1)
    assert f["decode_memory_bound_steps"] == 2


def test_compute_bound_decode_steps():
    f = attainable_seconds([2, 4], [1, 3], params=10, weight_bytes=100, kv_bytes_per_token=1, flops=1,
                           bandwidth=10)
    assert f["prefill_s"] == pytest.approx(120.0)
    assert f["decode_s"] == pytest.approx(40.0)  # 2 steps x 20 s of compute
    assert f["decode_memory_bound_steps"] == 0


def test_prefill_only_workload_has_no_decode_steps():
    f = attainable_seconds([8], [1], params=1, weight_bytes=1, kv_bytes_per_token=1, flops=16, bandwidth=1)
    assert f == {"prefill_s": 1.0, "decode_s": 0.0, "total_s": 1.0, "decode_memory_bound_steps": 0}


def test_sustained_rate_is_total_work_over_total_time_with_window_trace():
    from kvserve.roofline import sustained_rate

    # a fake clock: the warm-up call, then calls that take 0.1 s, 0.1 s, 0.3 s, 0.1 s, ...
    durations = iter([0.5, 0.1, 0.1, 0.3, 0.1, 0.1, 0.3, 0.1, 0.1, 0.3])
    now = [0.0]
    calls = []

    def fn():
        calls.append(1)
        now[0] += next(durations)

    rate, trace = sustained_rate(fn, work_per_call=10.0, seconds=1.0, window_s=0.25, clock=lambda: now[0])
    # timing starts after the warm-up (t = 0.5); calls end at 0.6, 0.7, 1.0, 1.1, 1.2, 1.5: 1.0 s in 6 calls
    assert len(calls) == 7
    assert rate == pytest.approx(60.0)
    # windows close at 1.0 (3 calls in 0.5 s) and 1.5 (3 calls in 0.5 s)
    assert trace == pytest.approx([60.0, 60.0])
