"""Model implementations (plain PyTorch), one module per architecture family."""

from __future__ import annotations


def model_class(architecture: str):
    """The kvserve model class for a :class:`kvserve.config.ModelConfig` ``architecture``:
    :class:`kvserve.worker.models.gemma3.Gemma3ForCausalLM` for Gemma 3, else the Llama family's
    :class:`kvserve.worker.models.llama.LlamaForCausalLM`."""
    if architecture == "Gemma3ForCausalLM":
        from kvserve.worker.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from kvserve.worker.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
