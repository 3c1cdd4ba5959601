"""The one-call C decode step's phase timer (``DecodeStep.profile``, what
``benchmarks/decode_breakdown.py`` reads): it times every phase, changes no result, and
refuses a buffer it could overrun."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ops


def _decode_step(llm):
    step = llm.engine.model._decode_step
    assert step is not None, "the C decode step did not run"
    return step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_times_every_phase_and_changes_no_result(tiny_model_dir, dtype):
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype=dtype, num_blocks=64, block_size=4, device="cpu", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 99, 3, 250, 40, 41], [300, 301]]

    def run():
        return [(o.outputs[0].token_ids, [(t.logprob, t.top) for t in o.outputs[0].token_logprobs])
                for o in llm.generate(prompts, params)]

    plain = run()
    step = _decode_step(llm)
    prof = torch.zeros(len(step.PHASES), dtype=torch.int64)
    step.profile = prof
    timed = run()
    step.profile = None
    assert timed == plain  # bit-equal logprobs: the timer only reads the clock
    t = dict(zip(step.PHASES, prof.tolist()))
    assert set(t) == {"norm", "qkv", "rope", "kv_write", "attention", "o_proj", "gate_up", "silu_mul", "down",
                      "lm_head"}
    assert all(v > 0 for v in t.values()), t  # 11 decode steps ran every phase
    assert sum(t.values()) < 10e9  # ns, not garbage
    after = prof.clone()
    run()
    assert torch.equal(prof, after)  # detached: no more accumulation


def test_profile_rejects_a_buffer_of_the_wrong_kind(tiny_model_dir):
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=32, block_size=4, device="cpu")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    step = _decode_step(llm)
    n = len(step.PHASES)
    for bad in (torch.zeros(n - 1, dtype=torch.int64), torch.zeros(n, dtype=torch.int32),
                torch.zeros(2 * n, dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="DecodeStep.profile"):
            step.profile = bad
    assert step.profile is None
