"""Input processing: a user's prompt and sampling parameters → an :class:`EngineCoreRequest`.

This is the part of a request's life that needs the tokenizer and the model's config but no
weights and no KV cache, so it runs wherever requests arrive: in the offline :class:`LLM`'s
process, and in the API process of ``kvserve serve`` while the engine core runs in its own.

It checks the request's own fields (types, ``priority``, ``cache_salt``, ``request_id``),
takes a private copy of the parameters (later changes by the caller must not reach a running
request), turns ``bad_words`` strings into token ids, tokenizes a text prompt and applies
``truncate_prompt_tokens``. What depends on the engine's state (the prompt against the KV
pool, the waiting queue) is checked by the engine core when the request arrives there
(:meth:`kvserve.engine.core.EngineCore.add_request`).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.engine.tokenizer import bad_words_token_ids
from kvserve.sampling_params import SamplingParams, require_utf8


@dataclass
class EngineCoreRequest:
    """A request as the engine core receives it: token ids and checked parameters.

    Attributes:
        request_id: the user's id, or None for one the core generates (``req-N``).
        prompt_token_ids: the prompt, token ids (after truncation).
        prompt: the prompt's text where it was given as text (else None).
        sampling_params: the request's own copy, ``bad_words`` as token ids.
        priority: lower runs first.
        cache_salt: tenant key for prefix-cache isolation, or None.
        user: who sent it (fair share of the sequence slots between users), or None.
        kv_transfer_params: prefill/decode disaggregation (:mod:`kvserve.distributed.kv_transfer`):
            ``{"do_remote_decode": True}`` (save the prompt's K/V when the request finishes),
            or the :class:`~kvserve.distributed.kv_transfer.KVTransferHandle` a prefill engine
            returned (load it instead of computing the prompt); None.
    """

    request_id: Optional[str]
    prompt_token_ids: list[int]
    prompt: Optional[str]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: Optional[str] = None
    kv_transfer_params: Any = None
    user: Optional[str] = None


class InputProcessor:
    """Tokenization, truncation and the request-level checks of :class:`EngineCoreRequest`.

    Args:
        model_config: the model's config (``vocab_size``, names).
        tokenizer: the model's tokenizer (a ``transformers`` tokenizer).
        max_model_len: the engine's context window in tokens.
    """

    def __init__(self, model_config: ModelConfig, tokenizer, max_model_len: int) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt (the tokenizer's own special-token rules).

        Raises:
            ValueError: the text is not valid UTF-8 (lone surrogates).
        """
        return self.tokenizer.encode(require_utf8(prompt, "prompt"))

    def truncate_prompt(self, ids: list[int], text: Optional[str], k: Optional[int]) -> tuple[list[int], Optional[str]]:
        """The last ``k`` prompt tokens (``truncate_prompt_tokens``; -1: ``max_model_len - 1``)
        and, when that cut the prompt, their text (decoded); ``k=None`` changes nothing.

        Raises:
            ValueError: ``k`` exceeds ``max_model_len`` (vLLM's rule).
        """
        if k is None:
            return ids, text
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) exceeds max_model_len ({self.max_model_len})")
        k = self.max_model_len - 1 if k == -1 else k
        if len(ids) <= k:
            return ids, text
        ids = ids[-k:]
        return ids, (self.tokenizer.decode(ids) if text is not None else None)

    def process(
        self,
        prompt: str | Sequence[int],
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        user: Optional[str] = None,
    ) -> EngineCoreRequest:
        """Check and tokenize one request.

        Args:
            prompt: text (tokenized with the model's tokenizer), or token ids as a list, a
                tuple, or a 1-D integer numpy array / torch tensor.
            params: sampling parameters (default: ``SamplingParams()``).
            request_id: a string, or None.
            priority: an integer; lower runs first.
            cache_salt: a non-empty string, or None.
            user: a string (the scheduler shares the sequence slots fairly between users), or None.

        Raises:
            TypeError: ``params`` is not a SamplingParams, or the prompt is neither text nor
                1-D integer token ids.
            ValueError: a ``cache_salt``, ``priority`` or ``request_id`` of the wrong kind, a
                prompt that is not valid UTF-8, ``truncate_prompt_tokens`` above
                ``max_model_len``, or a field of ``params`` changed to a bad value since it
                was built.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string or None, got {type(request_id).__name__}")
        if user is not None and not isinstance(user, str):
            raise ValueError(f"user must be a string or None, got {type(user).__name__}")
        # A checked copy: fields may have been changed since the object was built (SamplingParams
        # checks them in __post_init__), and later changes must not reach a running request.
        params = dataclasses.replace(params)
        if params.bad_words and any(isinstance(w, str) for w in params.bad_words):  # vLLM's form: strings
            words = [w for w in params.bad_words if isinstance(w, str)]
            params.bad_words = ([w for w in params.bad_words if not isinstance(w, str)]
                                + bad_words_token_ids(self.tokenizer, words))
        text, ids = self._prompt(prompt)
        ids, text = self.truncate_prompt(ids, text, params.truncate_prompt_tokens)
        return EngineCoreRequest(request_id, ids, text, params, int(priority), cache_salt, user=user)

    def _prompt(self, prompt) -> tuple[Optional[str], list]:
        """``(text or None, token ids)`` of a prompt in any accepted form."""
        if isinstance(prompt, (np.ndarray, torch.Tensor)):
            integer = (np.issubdtype(prompt.dtype, np.integer) if isinstance(prompt, np.ndarray)
                       else not (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool))
            if prompt.ndim != 1 or not integer:
                raise TypeError(f"prompt token ids given as an array must be 1-D integers, got {prompt.ndim}-D "
                                f"{prompt.dtype}")
            prompt = prompt.tolist()
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        return None, [int(t) if isinstance(t, np.integer) else t for t in prompt]  # numpy integers count as ints
