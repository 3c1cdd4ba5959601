"""Offline API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch

from kvserve.engine.llm_engine import EngineArgs, LLMEngine, QueueFullError
from kvserve.core.request import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.engine.tokenizer import apply_chat_template

PromptType = Union[str, Sequence[int], dict]

# vLLM's prompt dicts (TextPrompt, TokensPrompt): keys kvserve reads, and those it accepts only empty
_PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_PROMPT_DICT_UNUSED = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def _prompt_and_salt(prompt) -> tuple[Union[str, Sequence[int]], Optional[str]]:
    """A prompt as the engine takes it (text or token ids) and its cache salt, from a text, a
    token-id list, or vLLM's ``TextPrompt`` ``{"prompt": text}`` / ``TokensPrompt``
    ``{"prompt_token_ids": ids}`` dicts (optionally with ``cache_salt``; a TokensPrompt's
    ``prompt`` text is then only a label).

    Raises:
        ValueError: a dict with neither key, an unknown key, or multimodal data.
    """
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(k for k in prompt if k not in _PROMPT_DICT_KEYS
                     and not (k in _PROMPT_DICT_UNUSED and not prompt[k]))
    if unknown:
        raise ValueError(f"prompt dict: unsupported key(s) {unknown}; kvserve reads 'prompt' (text) or "
                         f"'prompt_token_ids' (token ids), and 'cache_salt' (text-only models: no multimodal data)")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"], prompt.get("cache_salt")
    if "prompt" in prompt:
        return prompt["prompt"], prompt.get("cache_salt")
    raise ValueError(f"prompt dict must have 'prompt' (text) or 'prompt_token_ids' (token ids), got keys "
                     f"{sorted(prompt)}")


class GenerationError(ValueError):
    """Some prompts of a batch were invalid.

    From ``generate(...)`` the valid prompts still ran and ``outputs`` holds their results;
    from ``generate(..., stream=True)`` nothing ran (it is raised at the first iteration,
    before any token is generated) and ``outputs`` is all None.

    Attributes:
        errors: prompt index → error message.
        outputs: per prompt, its :class:`RequestOutput` (None for the invalid ones).
    """

    def __init__(self, errors: dict[int, str], outputs: list[Optional[RequestOutput]]) -> None:
        self.errors = errors
        self.outputs = outputs
        if len(outputs) == 1:  # one prompt: its own message says it all
            super().__init__(next(iter(errors.values())))
            return
        detail = "; ".join(f"prompt {i}: {m}" for i, m in sorted(errors.items()))
        ran = any(o is not None for o in outputs)
        super().__init__(f"{len(errors)} of {len(outputs)} requests were rejected: {detail}"
                         + (" (the other prompts ran; their results are in GenerationError.outputs)" if ran else ""))


class LLM:
    """Offline batched generation.

    Args:
        model: GGUF file or Hugging Face folder; None means the default SmolLM2-135M-Instruct.
        dtype: "bfloat16" (default) or "float32"; "float16" is accepted too (meant for CUDA:
            on CPU it runs without the fused kernels and is slower).
        **kwargs: any other :class:`kvserve.engine.llm_engine.EngineArgs` field (``kv_cache_memory``,
            ``max_model_len``, ``max_num_batched_tokens``, ``max_num_seqs``, ``block_size``,
            ``num_blocks``, ``enable_prefix_caching``, ``device``, ``quantization``, ``seed``,
            ``swap_space``, ``preemption_mode``, ``kv_offload_dir``, ``kv_offload_gib``: the prefix
            cache's disk tier, whose blocks a later ``LLM`` on the same directory reads back).

    Example:
        >>> llm = LLM(dtype="float32")
        >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
        >>> out[0].text
    """

    def __init__(self, model: Optional[str] = None, dtype: str = "bfloat16", **kwargs) -> None:
        fields = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}; engine arguments are "
                            f"{sorted(fields - {'model', 'dtype'})}")
        self.engine = LLMEngine(EngineArgs(model=model, dtype=dtype, **kwargs))
        self.tokenizer = self.engine.tokenizer
        # Outputs of requests whose stream is paused, produced while another call stepped the
        # engine; each stream drains its own when it resumes.
        self._pending: dict[str, list[RequestOutput]] = {}

    def shutdown(self) -> None:
        """Stop the engine's workers now (the rank processes of ``tensor_parallel_size > 1``);
        the engine cannot be used afterwards. With ``kv_offload_dir``, the prefix cache's blocks
        are written to the disk tier first. Also done when the ``LLM`` is garbage-collected and
        at exit."""
        self.engine.shutdown()

    def _submit(self, prompts, params, stream: bool = False) -> tuple[list[Optional[str]], dict[int, str]]:
        if isinstance(prompts, (np.ndarray, torch.Tensor)) and prompts.ndim == 1:
            prompts = [prompts]  # one prompt of token ids
        elif isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                  and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict ({{'prompt': text}} or "
                            f"{{'prompt_token_ids': ids}}), or a list of those; got {type(prompts).__name__}")
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids: list[Optional[str]] = []
        errors: dict[int, str] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            try:
                if stream and isinstance(sp, SamplingParams) and (
                        sp.use_beam_search or (sp.best_of is not None and sp.best_of > sp.n)):
                    raise ValueError("use_beam_search and best_of > n are not supported with stream (the best "
                                     "sequences are only known at the end)")
                p, salt = _prompt_and_salt(p)
                ids.append(self.engine.add_request(p, sp, cache_salt=salt))
            except (ValueError, TypeError, QueueFullError) as e:  # this prompt's error: the others run
                ids.append(None)
                errors[i] = str(e)
        return ids, errors

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        stream: bool = False,
    ):
        """Generate for every prompt.

        Args:
            prompts: a string, a token-id list, vLLM's prompt dict (``{"prompt": text}`` or
                ``{"prompt_token_ids": ids}``, optionally with ``"cache_salt"``), or a list of those.
            sampling_params: one for all prompts, or one per prompt.
            stream: when True, return an iterator of :class:`RequestOutput` updates (each
                carries ``outputs[i].delta_text``; a sample of an n > 1 request appears for
                the last time in the update that gives its finish_reason) instead of the final
                list. The prompts are queued when the iteration starts (an iterator never
                started runs nothing); close it (``.close()``, or drop every reference) to
                abort what has not finished: a ``break`` alone leaves the requests running
                while the iterator is still referenced. Not with beam search or
                best_of > n (the best sequences are only known at the end).

        Returns:
            One :class:`RequestOutput` per prompt, in order (text, token ids, finish reason,
            metrics with TTFT and decode tokens/s). A request that failed inside the engine
            (a bug; the engine logs its traceback) has ``finish_reason == "error"``, the
            message in ``.error`` and the tokens it had; the others are unaffected.

        Raises:
            TypeError: ``prompts`` is none of the accepted forms (a 1-D integer numpy array or
                tensor counts as a token-id list).
            GenerationError: some prompts were invalid or found the waiting queue full
                (``max_waiting``). Without ``stream``, raised after the
                valid ones finished (``.outputs`` holds their results); with ``stream``, raised
                at the first iteration and no prompt runs.
        """
        if stream:  # the requests are queued at the first iteration: a stream never iterated costs nothing
            return self._stream(prompts, sampling_params)
        ids, errors = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        for out in self._run(ids):
            if out.finished:
                final[out.request_id] = out
        outputs = [final.get(i) if i is not None else None for i in ids]
        if errors:
            raise GenerationError(errors, outputs)
        return outputs

    def _stream(self, prompts, sampling_params) -> Iterator[RequestOutput]:
        ids, errors = self._submit(prompts, sampling_params, stream=True)
        if errors:
            for i in ids:
                if i is not None:
                    self.engine.abort_request(i)
            raise GenerationError(errors, [None] * len(ids))
        ended: set[tuple[str, int]] = set()  # samples whose finish_reason was reported
        for out in self._run(ids):
            outputs = [o for o in out.outputs if (out.request_id, o.index) not in ended]
            ended.update((out.request_id, o.index) for o in outputs if o.finish_reason is not None)
            yield out if len(outputs) == len(out.outputs) else dataclasses.replace(out, outputs=outputs)

    def _run(self, ids: list[Optional[str]]) -> Iterator[RequestOutput]:
        """Step the engine until the requests ``ids`` finish, yielding only their outputs.

        Other requests in the engine (a paused stream's) keep running; their outputs are kept
        for their own stream. Closing this iterator early (``.close()``, or garbage collection
        of an abandoned one) aborts the requests that have not finished, so they cost nothing
        afterwards.
        """
        order = [i for i in ids if i is not None]
        left = set(order)
        try:
            while left:
                ready = [i for i in order if i in left and i in self._pending]
                if ready:  # (filed by this call or by another one that stepped meanwhile)
                    for rid in ready:
                        for out in self._pending.pop(rid, ()):
                            if out.finished:
                                left.discard(rid)
                            yield out
                    continue  # more may have been filed while this generator was paused
                if not self.engine.has_unfinished_requests():
                    break
                # every output of the step is filed before any is yielded: a paused stream
                # must find its outputs in order when it resumes, whoever stepped meanwhile
                for out in self.engine.step():
                    self._pending.setdefault(out.request_id, []).append(out)
        finally:
            for rid in left:
                self.engine.abort_request(rid)
                self._pending.pop(rid, None)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        stream: bool = False,
    ):
        """Generate replies to conversations rendered with the model's chat template.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts), or a list
                of conversations (as vLLM's ``LLM.chat`` takes).
            sampling_params: one for all conversations, or one per conversation.
            stream: as in :meth:`generate`.

        Returns:
            For one conversation its :class:`RequestOutput`; for a list, one per conversation,
            in order (or the stream of updates).

        Raises:
            ValueError: a conversation the OpenAI server would answer with a 400 (the same
                check, :func:`kvserve.entrypoints.openai.protocol.chat_messages`): empty, a message
                that is not a dict, a role not in ``system``, ``developer``, ``user``,
                ``assistant``, ``tool``, a message without content; naming the conversation (when
                several) and the message. Content given as a list of text parts is joined, as the
                server does, and ``developer`` is rendered as ``system``.
        """
        from kvserve.entrypoints.openai.protocol import APIError, chat_messages

        many = bool(messages) and isinstance(messages[0], (list, tuple))
        convs = messages if many else [messages]
        checked = []
        for i, conv in enumerate(convs):
            try:
                checked.append(chat_messages(list(conv) if isinstance(conv, (list, tuple)) else conv))
            except APIError as e:
                raise ValueError(f"LLM.chat: {f'conversation {i}: ' if many else ''}{e.message}") from None
        ids = [apply_chat_template(self.tokenizer, m, add_generation_prompt=True) for m in checked]
        res = self.generate(ids, sampling_params, stream=stream)
        return res if stream or many else res[0]
