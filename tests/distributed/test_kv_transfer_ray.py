"""The ``"ray"`` KV connector across processes: the prefill engine in the test process puts a
request's prompt K/V into Ray's object store, a decode engine in a Ray actor (another process)
loads it from the handle and decodes: the same tokens as one engine; the decode engine computed
one prompt token per request. Two processes on 2 cores: slow, but they prove the transfer."""

import pytest
import torch

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine

ray = pytest.importorskip("ray")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]]
ARGS = dict(dtype="float32", num_blocks=64, block_size=4, max_model_len=128)


def _run(engine, requests) -> list:
    rids = [engine.add_request(p, params, kv_transfer_params=kv) for p, params, kv in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in rids]


def _decode_engine_class():
    """A decode engine for a Ray actor: defined here, self-contained, so that Ray ships it by
    value (the test module is not importable in the actor's process)."""

    class DecodeEngine:
        def __init__(self, model: str, args: dict) -> None:
            from kvserve.engine.llm_engine import EngineArgs, LLMEngine

            self.engine = LLMEngine(EngineArgs(model=model, kv_connector="ray", **args))

        def decode(self, prompts, handles, max_tokens: int):
            from kvserve import SamplingParams

            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            rids = [self.engine.add_request(p, params, kv_transfer_params=h) for p, h in zip(prompts, handles)]
            final = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out.outputs[0].token_ids
            return [final[r] for r in rids], self.engine.stats()

    return DecodeEngine


@pytest.fixture(scope="module")
def ray_cluster():
    from kvserve.executor.ray_executor import connect_ray

    started = connect_ray(2, torch.device("cpu"))
    yield
    if started:
        ray.shutdown()


def test_prefill_here_decode_in_another_process(tiny_model_dir, ray_cluster):
    folder = str(tiny_model_dir("llama")[0])
    prefill = LLMEngine(EngineArgs(model=folder, kv_connector="ray", **ARGS))
    alone = LLMEngine(EngineArgs(model=folder, **ARGS))
    ref = _run(alone, [(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), None) for p in PROMPTS])
    outs = _run(prefill, [(p, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
                          for p in PROMPTS])
    handles = [o.kv_transfer_params for o in outs]
    assert all(h.connector == "ray" and h.num_bytes > 0 for h in handles)
    actor = ray.remote(num_cpus=0)(_decode_engine_class()).remote(folder, ARGS)
    try:
        tokens, stats = ray.get(actor.decode.remote(PROMPTS, handles, 12), timeout=300)
    finally:
        ray.kill(actor)
    assert tokens == [o.outputs[0].token_ids for o in ref]
    assert stats["prompt_tokens_computed"] == len(PROMPTS)  # the one owed per request
    assert stats["kv_transfer_loaded_blocks"] == sum(h.num_blocks for h in handles)
