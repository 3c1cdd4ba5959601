"""The workload and helpers the tensor-parallel engine tests share (mp and Ray executors): run
requests to the end, summarize outputs, and a mixed workload touching every feature."""

from kvserve import SamplingParams, StructuredOutputsParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [20, 21], [5, 6, 7, 8, 30, 31]]


def run(engine, requests) -> list:
    """Add ``(prompt, params)`` requests and step until all finish; their final outputs, in order."""
    rids = [engine.add_request(p, params) for p, params in requests]
    final = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return [final[r] for r in rids]


def summary(out) -> list:
    """What must be equal between two runs of a request: each sample's tokens, text and finish."""
    return [(c.index, c.token_ids, c.text, c.finish_reason, str(c.stop_reason)) for c in out.outputs]


def mixed_workload() -> list:
    """Greedy prompts, a prefix-cache hit, n / best_of / beams, a grammar and sampled logprobs."""
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reqs = [(p, greedy) for p in PROMPTS]
    reqs += [
        (PROMPTS[1], greedy),  # a prefix-cache hit on the second prompt
        (PROMPTS[0], SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)),
        (PROMPTS[3], SamplingParams(n=2, best_of=3, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(n=2, use_beam_search=True, beam_width=3, max_tokens=8, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=16, temperature=0,
                                    structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,12}"))),
        (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.8, seed=5, top_p=0.9, logprobs=2)),
    ]
    return reqs
