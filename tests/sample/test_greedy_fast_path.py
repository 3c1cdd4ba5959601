"""The greedy fast path (``sampler.plain_greedy`` + ``Sampler.greedy``): which rows take it, that
it returns exactly what the full sampler returns for them, and that an engine's outputs do not
change when its decode steps skip the sampling rows and metadata. Tiny tensors and a tiny model; ~3 s."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu_ops
from kvserve.sample import sampler as S
from kvserve.worker import model_runner


def test_plain_greedy_is_the_bare_argmax_only():
    base = dict(temperature=0.0, max_tokens=8)
    assert S.plain_greedy(SamplingParams(**base), 0)
    assert S.plain_greedy(SamplingParams(temperature=0.7, top_k=1, max_tokens=8), 3)  # top_k 1 is greedy too
    assert S.plain_greedy(SamplingParams(**base, min_tokens=2), 2)  # min_tokens reached
    not_plain = [
        (dict(temperature=0.7), 0),
        (dict(logprobs=0), 0),
        (dict(logit_bias={5: 1.0}), 0),
        (dict(allowed_token_ids=[1, 2]), 0),
        (dict(bad_words=["a"]), 0),
        (dict(min_tokens=3), 2),  # its EOS may still be banned
        (dict(repetition_penalty=1.1), 0),
        (dict(frequency_penalty=0.5), 0),
        (dict(presence_penalty=-0.5), 0),
    ]
    for extra, n_out in not_plain:
        assert not S.plain_greedy(SamplingParams(**{**base, **extra}), n_out), extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_greedy_equals_the_full_sampler(dtype):
    if not cpu_ops.available():
        pytest.skip("needs the CPU kernels")
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 1000, generator=g) * 4).to(dtype)
    logits[1, 17] = logits[1, 400] = logits[1].max() + 1  # a tie: the first index wins
    p = SamplingParams(temperature=0.0, max_tokens=4)
    rows = [S.SamplingRow(params=p, prompt_token_ids=[1, 2], output_token_ids=[], seed=0, eos_token_id=2)] * 3
    full = S.Sampler()(logits, S.SamplingMetadata.build(rows, 1000, logits.device))
    fast = S.Sampler.greedy(logits)
    assert fast.sampled_token_ids.tolist()[1] == 17
    assert torch.equal(fast.sampled_token_ids, full.sampled_token_ids)
    assert torch.equal(fast.logprobs, full.logprobs) and torch.equal(fast.ranks, full.ranks)
    assert fast.top_token_ids is None and full.top_token_ids is None
    bad = logits.clone()
    bad[2, 3] = float("nan")
    assert S.Sampler.greedy(bad) is None  # a non-finite row: the caller takes the full sampler
    assert S.Sampler.greedy(logits[:, ::2]) is None  # (no unit last stride)


def test_engine_outputs_are_the_same_without_the_fast_path(tiny_model_dir, monkeypatch):
    folder, _ = tiny_model_dir("llama")
    llm = LLM(model=str(folder), dtype="bfloat16", num_blocks=64, block_size=4, enable_prefix_caching=False,
              device="cpu")  # (the fast path is the CPU sampler's)
    prompts = [[5, 17, 99, 3, 250], [300, 301], [77] * 9]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, min_tokens=4),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, repetition_penalty=1.3)]  # (ends first)

    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, params)]

    taken = []
    orig = S.Sampler.greedy

    def spy(logits):
        out = orig(logits)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(S.Sampler, "greedy", staticmethod(spy))
    fast = run()
    assert any(taken) == cpu_ops.available()  # (the steps whose rows were all plain greedy)
    monkeypatch.setattr(model_runner, "plain_greedy", lambda params, n: False)
    taken.clear()
    assert run() == fast
    assert not taken
