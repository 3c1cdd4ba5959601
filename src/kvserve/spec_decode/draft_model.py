"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens.

The draft model runs on its own paged KV cache (kvserve's model, KV manager and model
runner, with prefix caching off). Each engine step, for every request that decodes next,
it runs k autoregressive steps batched over those requests: the first over the tokens
the draft has not seen yet (the accepted drafts and the bonus token of the last round, or
the whole prompt the first time), the others one draft each. A greedy request takes the
draft model's argmax (its distribution q is not needed: verification accepts a draft
while it equals the target's argmax); a sampled request draws each draft from q, the draft
model's logits processed by the request's own sampling pipeline (bias, allowed ids, bans,
penalties over its output and the drafts so far, temperature, min-p, top-k, top-p), with
``row_uniform(seed, step, stream=2)``, and q is kept for the rejection sampler, which is
exact for any q (Leviathan et al. 2023, Chen et al. 2023).

The draft's KV pool holds K/V in the model dtype, or in 8 bits (``int8``, a scale per token and
head: :mod:`kvserve.worker.kv_quant`) when the target's cache is 2-/4-bit (``kv_cache_dtype``
int4/int2): that target's pool holds 2.9-4.6x the blocks of a model-dtype one in the same budget,
and the draft's pool has as many blocks; 8-bit rows depend on their token only, so the draft's
rollbacks (below) need none of the residual-slot bookkeeping of the 2-/4-bit format. The target's
greedy output does not depend on the draft's KV format (only on which drafts are proposed, and a
greedy verification keeps the target's own tokens whatever they are).

The draft's K/V of a request stays valid across rounds for the tokens that were accepted:
after a round fed drafts ``d_1..d_{k-1}`` at positions ``L..L+k-2``, the next round starts
from ``L`` plus the leading drafts that the sequence now holds.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from kvserve.worker.attention import default_backend
from kvserve.config import ModelConfig
from kvserve.core.kv_cache_manager import KVCacheManager, allocate_kv_cache, plan_kv_cache
from kvserve.worker.loader import load_weights, resolve_model_path
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.models import model_class
from kvserve.core.request import Request
from kvserve.sample.sampler import (SamplingMetadata, SamplingRow, _argmax, _inverse_cdf, process_logits, row_uniform,
                             sampling_probs)
from kvserve.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DRAFT_STREAM = 2  # row_uniform stream of the draft model's draws


class _Shadow:
    """The draft model's view of one request: a Request sharing its prompt, with its own
    copy of the output (plus the drafts fed this round) and its own computed count."""

    def __init__(self, req: Request) -> None:
        params = dataclasses.replace(req.sampling_params, prompt_logprobs=None, logprobs=None)
        self.seq = Request(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling_params=params,
                           seed=req.seed)
        self.base = 0  # sequence length when the drafts of the last round were fed
        self.fed: list[int] = []  # drafts whose K/V the draft model computed in the last round


class DraftModelProposer:
    """Proposes up to k tokens per request with a draft model.

    Args:
        model: the draft model's path (GGUF file or Hugging Face folder).
        num_speculative_tokens: k.
        target_config: the target's config (vocabulary and context are checked against it).
        dtype, device: as the target's.
        num_blocks, block_size: the draft KV pool (the target's geometry: it then holds as
            many tokens as the target's).
        max_model_len: longest sequence.
        kv_cache_dtype: the draft pool's dtype (``dtype``, the default, or ``torch.int8``); an
            8-bit pool needs a ``head_dim`` divisible by 4, else the draft keeps ``dtype``.

    Raises:
        ValueError: naming ``speculative_config.model``: the draft's vocabulary size or
            tokens differ from the target's, its context is shorter than ``max_model_len``,
            or its file cannot be loaded (corrupt, unsupported architecture).
        ModelNotFoundError: the path does not exist.
    """

    def __init__(self, model: str, num_speculative_tokens: int, target_config: ModelConfig, target_tokenizer,
                 dtype: torch.dtype, device: torch.device, num_blocks: int, block_size: int,
                 max_model_len: int, kv_cache_dtype: Optional[torch.dtype] = None) -> None:
        from kvserve.engine.tokenizer import load_tokenizer

        from kvserve.config import UnsupportedModelError
        from kvserve.worker.loader import ModelLoadError

        try:
            path = resolve_model_path(model)
            cfg, state = load_weights(path)
        except (ModelLoadError, UnsupportedModelError) as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        if cfg.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary has {cfg.vocab_size} tokens, "
                             f"the target's {target_config.vocab_size}: they must share one vocabulary")
        tok = load_tokenizer(path)
        if tok.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError("speculative_config.model: the draft model's tokenizer maps tokens to other ids than "
                             "the target's: they must share one vocabulary")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model: the draft model's context ({cfg.max_position_embeddings} "
                             f"tokens) is shorter than max_model_len ({max_model_len})")
        self.k = num_speculative_tokens
        self.config = cfg
        backend = default_backend(device, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        # whole, in the engine core's process (with tensor parallelism: beside rank 0, whose
        # process group it must not join: its forward runs no collective)
        self.model = model_class(cfg.architecture)(cfg, backend, dtype, device, max_positions=max_model_len,
                                                   tp_rank=0, tp_size=1)
        self.model.load_weights(state)
        del state
        self.model.eval()
        kv_dtype = dtype if kv_cache_dtype is None or cfg.head_dim % 4 else kv_cache_dtype
        spec = plan_kv_cache(cfg, kv_dtype, 1.0, block_size, max_model_len, num_blocks)
        self.kv_caches = allocate_kv_cache(cfg, spec, kv_dtype, device)
        self.kv = KVCacheManager(num_blocks, block_size, False, self.kv_caches)
        self.runner = ModelRunner(self.model, self.kv_caches, self.kv.block_tables, block_size, device)
        self.device = device
        self._shadows: dict[str, _Shadow] = {}

    # ------------------------------------------------------------------ state
    def free(self, request_id: str) -> None:
        """Forget a request (finished or aborted): its draft blocks go back to the pool."""
        sh = self._shadows.pop(request_id, None)
        if sh is not None:
            self.kv.free(sh.seq, cache=False)

    def retain(self, live: set[str]) -> None:
        """Free every request not in ``live``."""
        for rid in [r for r in self._shadows if r not in live]:
            self.free(rid)

    def _sync(self, req: Request) -> Optional[_Shadow]:
        """The request's shadow with its output brought up to date and its computed count
        cut to the K/V that still matches the sequence; None when it cannot get blocks."""
        sh = self._shadows.get(req.request_id)
        if sh is None:
            sh = self._shadows[req.request_id] = _Shadow(req)
        seq = sh.seq
        out = req.output_token_ids
        tail = token_tail(req, sh.base, len(sh.fed))
        same = 0
        while same < len(sh.fed) and same < len(tail) and sh.fed[same] == tail[same]:
            same += 1
        seq.output_token_ids = list(out)
        seq.num_computed_tokens = min(seq.num_computed_tokens, sh.base + same, req.num_tokens - 1)
        return sh

    # --------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, reqs: list[Request], rooms: list[int]) -> list[tuple[list[int], Optional[torch.Tensor]]]:
        """Drafts for ``reqs`` (each at most ``min(k, room)``): per request ``(draft ids,
        q [num_drafts, V] float32 or None for greedy requests)``; ``([], None)`` where the
        draft pool has no room."""
        ks = [min(self.k, r) for r in rooms]
        live: list[tuple[int, _Shadow]] = []
        for i, (req, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                continue
            sh = self._sync(req)
            seq = sh.seq
            # the whole round's slots at once: the last real token's position + k - 1 drafts
            if not self.kv.allocate_slots(seq, req.num_tokens + k - 1 - seq.num_computed_tokens):
                self.free(req.request_id)
                continue
            sh.base, sh.fed = req.num_tokens, []
            live.append((i, sh))
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for step in range(max((ks[i] for i, _ in live), default=0)):
            active = [(i, sh) for i, sh in live if step < ks[i]]
            if not active:
                break
            sched = SchedulerOutput(scheduled=[(sh.seq, sh.seq.num_tokens - sh.seq.num_computed_tokens)
                                               for _, sh in active])
            batch = self.runner.prepare_inputs(sched)
            logits = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, batch.logits_indices)
            row_of = {r.request_id: row for r, row in zip(batch.sample_requests, batch.sample_rows)}
            rows = torch.tensor([row_of[sh.seq.request_id] for _, sh in active], dtype=torch.long, device=logits.device)
            logits = logits[rows].float()
            toks = self._draw(logits, [reqs[i] for i, _ in active], [sh for _, sh in active], step,
                              [qs[i] for i, _ in active])
            for (i, sh), (_, n), t in zip(active, sched.scheduled, toks):
                sh.seq.num_computed_tokens += n
                drafts[i].append(t)
                if step + 1 < ks[i]:  # fed to the next step
                    sh.seq.output_token_ids.append(t)
                    sh.fed.append(t)
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, qs)]

    def _draw(self, logits: torch.Tensor, reqs: list[Request], shadows: list[_Shadow], step: int,
              qs: list[list[torch.Tensor]]) -> list[int]:
        """One draft per row from the draft logits [R, V] processed as the request's own
        sampler would (:func:`process_logits`, :func:`sampling_probs`: bias, bans, penalties
        over its output and the drafts so far, temperature, min-p, top-k, top-p): the argmax
        for greedy requests, else a draw from that distribution q, appended to ``qs``."""
        rows = [SamplingRow(params=r.sampling_params, prompt_token_ids=r.prompt_token_ids,
                            output_token_ids=sh.seq.output_token_ids, seed=r.seed, eos_token_id=list(r.eos_token_ids))
                for r, sh in zip(reqs, shadows)]
        meta = SamplingMetadata.build(rows, logits.shape[1], logits.device)
        x = process_logits(logits, meta)
        toks = [0] * len(reqs)
        if meta.num_greedy:
            g = list(range(len(reqs))) if meta.greedy_idx is None else meta.greedy_idx.tolist()
            for j, t in zip(g, _argmax(x if meta.greedy_idx is None else x[meta.greedy_idx]).tolist()):
                toks[j] = t
        if meta.num_greedy < len(reqs):
            s_idx = list(range(len(reqs))) if meta.sample_idx is None else meta.sample_idx.tolist()
            q = sampling_probs(x, meta)
            q = q / q.sum(dim=1, keepdim=True)
            u = torch.tensor([row_uniform(reqs[j].seed, len(reqs[j].output_token_ids) + step, DRAFT_STREAM)
                              for j in s_idx], dtype=torch.float64, device=logits.device)
            for n, (j, t) in enumerate(zip(s_idx, _inverse_cdf(q, u).tolist())):
                toks[j] = t
                qs[j].append(q[n])
        return toks


def token_tail(req: Request, start: int, n: int) -> list[int]:
    """Up to ``n`` tokens of prompt + output from position ``start``."""
    p = len(req.prompt_token_ids)
    out = req.output_token_ids
    if start >= p:
        return out[start - p : start - p + n]
    return (req.prompt_token_ids[start:] + out)[:n]
