"""LLMEngine: input processing, the engine core and output processing in one process.

:class:`LLMEngine` is what the offline :class:`~kvserve.entrypoints.llm.LLM` drives and what
most tests build: a prompt in any accepted form goes through the
:class:`~kvserve.engine.input_processor.InputProcessor` (tokenize, truncate, request-level
checks) into the :class:`~kvserve.engine.core.EngineCore` (validate against the pool, queue);
:meth:`step` is the core's step, whose token deltas the
:class:`~kvserve.engine.output_processor.OutputProcessor` turns into text and
:class:`RequestOutput` s (a sample it ends at a stop string is finished in the core before
the next step). ``kvserve serve`` puts the same pieces in two processes instead: the API
process processes inputs and outputs, the core process steps.

The core's state (``scheduler``, ``kv``, ``executor``, ``model``, ``runner``, ``kv_caches``,
``groups``, ``tokenizer``, ``model_config``, ``max_model_len``, ...) is reachable as
attributes of the engine, for inspection.
"""

from __future__ import annotations

from typing import Optional, Sequence

from kvserve.engine.args import DTYPES, MAX_KV_CACHE_GIB, EngineArgs, parse_device, parse_dtype
from kvserve.engine.core import EngineCore, QueueFullError
from kvserve.engine.input_processor import EngineCoreRequest, InputProcessor
from kvserve.engine.output_processor import OutputProcessor
from kvserve.core.request import RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["DTYPES", "MAX_KV_CACHE_GIB", "EngineArgs", "LLMEngine", "QueueFullError", "parse_device", "parse_dtype"]


class LLMEngine:
    """The serving engine in one process: requests in, :class:`RequestOutput` per step out.

    Args:
        args: the engine's arguments.

    Raises at construction:
        ModelNotFoundError: the model path does not exist / default model not installed.
        ModelLoadError: the file is corrupt.
        UnsupportedModelError: the architecture is not implemented.
        ValueError: a bad engine argument.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.core = EngineCore(args)
        self.input_processor = InputProcessor(self.core.model_config, self.core.tokenizer, self.core.max_model_len)
        self.output_processor = OutputProcessor(self.core.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        """``LLMEngine(engine_args)``, by vLLM's name."""
        return cls(engine_args)

    def __getattr__(self, name: str):  # the core's state, read through the engine
        if name == "core":  # (not built yet: __init__ failed)
            raise AttributeError(name)
        return getattr(self.core, name)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a plain-text prompt (:meth:`InputProcessor.encode`)."""
        return self.input_processor.encode(prompt)

    def truncate_prompt(self, ids: list[int], text: Optional[str], k: Optional[int]) -> tuple[list[int], Optional[str]]:
        """``truncate_prompt_tokens`` applied to a prompt (:meth:`InputProcessor.truncate_prompt`)."""
        return self.input_processor.truncate_prompt(ids, text, k)

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Check a request against the model and the pool (:meth:`EngineCore.validate_request`)."""
        return self.core.validate_request(prompt_token_ids, params)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        kv_transfer_params=None,
        user: Optional[str] = None,
    ) -> str:
        """Queue a request; returns its id. vLLM's argument order, ``add_request(request_id,
        prompt, params)``, is read too (a :class:`SamplingParams` third and a prompt second).

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            params: sampling parameters (default: ``SamplingParams()``).
            request_id: unique id (generated when None); any string: the engine's own
                sequence ids (``Request.request_id``) cannot collide with it.
            priority: lower runs first (an integer).
            cache_salt: tenant key for prefix-cache isolation.
            kv_transfer_params: prefill/decode disaggregation (needs ``kv_connector``):
                ``{"do_remote_decode": True}`` to save the prompt's K/V when the request
                finishes (its final output's ``kv_transfer_params`` is the handle), or a
                prefill engine's handle, to load that K/V instead of computing the prompt.
            user: who sent it: with requests of several users, the scheduler shares the
                sequence slots fairly between them (:mod:`kvserve.core.scheduler`).

        Raises:
            ValueError: invalid prompt or params (:meth:`InputProcessor.process`,
                :meth:`EngineCore.validate_request`), a ``request_id`` in use or not a string, a
                ``priority`` that is not an integer; the engine and every other request are
                unaffected.
            QueueFullError: the waiting queue holds ``max_waiting`` requests.
        """
        if isinstance(request_id, SamplingParams) and not isinstance(params, SamplingParams):  # (vLLM's order)
            request_id, prompt, params = prompt, params, request_id
        request = self.input_processor.process(prompt, params, request_id, priority, cache_salt, user=user)
        request.kv_transfer_params = kv_transfer_params
        return self.add_core_request(request)

    def add_core_request(self, request: EngineCoreRequest) -> str:
        """Queue a request already processed by an :class:`InputProcessor` (:meth:`EngineCore.add_request`)."""
        rid = self.core.add_request(request)
        self.output_processor.add_request(rid, request.prompt_token_ids, request.prompt, request.sampling_params)
        return rid

    def add_core_requests(self, requests: Sequence[EngineCoreRequest]) -> list[str]:
        """Queue every request of ``requests`` or none (:meth:`EngineCore.add_requests`)."""
        rids = self.core.add_requests(requests)
        for rid, r in zip(rids, requests):
            self.output_processor.add_request(rid, r.prompt_token_ids, r.prompt, r.sampling_params)
        return rids

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at once. Unknown ids are ignored."""
        self.core.abort_request(request_id)
        self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of the engine core (:meth:`EngineCore.step`), its outputs processed
        (:meth:`OutputProcessor.process_outputs`): an output for every request that changed."""
        processed = self.output_processor.process_outputs(self.core.step())
        if processed.finished_samples:
            self.core.finish_samples(processed.finished_samples)
        for rid in processed.failed:
            self.core.abort_request(rid)
        return processed.request_outputs

    def shutdown(self) -> None:
        """Stop the workers (:meth:`EngineCore.shutdown`); the engine cannot step afterwards."""
        self.core.shutdown()

    def stats(self) -> dict:
        """The engine core's counters (:meth:`EngineCore.stats`)."""
        return self.core.stats()

    def flush_kv_offload(self) -> None:
        """Wait for the disk tier's queued writes and count them (:meth:`EngineCore.flush_kv_offload`)."""
        self.core.flush_kv_offload()

    def kv_offload_pending(self) -> bool:
        """Whether disk-tier writes are in flight, not counted yet (:meth:`EngineCore.kv_offload_pending`)."""
        return self.core.kv_offload_pending()
