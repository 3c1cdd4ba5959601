"""The check that a model's one-call C decode step equals its module path (used by the model tests)."""

from kvserve.worker.models.llama import LlamaForCausalLM


def assert_c_decode_step_equals_modules(monkeypatch, run):
    """Run ``run()`` twice: with the one-call C decode step (``LlamaForCausalLM._get_decode_step``),
    asserting it was built for every decode-only step, then with it disabled (the module path).
    The two results must be equal; returns the first."""
    calls = []
    orig = LlamaForCausalLM._get_decode_step

    def spy(self, kv_caches, n):
        step = orig(self, kv_caches, n)
        calls.append(step is not None)
        return step

    monkeypatch.setattr(LlamaForCausalLM, "_get_decode_step", spy)
    fast = run()
    assert calls and all(calls), calls  # every decode-only step ran in C
    monkeypatch.setattr(LlamaForCausalLM, "_get_decode_step", lambda self, kv, n: None)
    assert run() == fast
    return fast
