"""ModelRunner: turns a :class:`SchedulerOutput` into batch tensors, runs the model, samples.

Batch layout: all scheduled tokens of all requests are flattened into one batch of ``T``
tokens — decode rows (one new token) first, then prefill chunks. Per token we build
``input_ids``, ``positions`` and ``slot_mapping``; per decode row its block table and context
length, or, for backends that gather (``uses_context_slots``), the slots of its whole context. Logits are computed only for the last token of
requests whose every known token is now computed (they sample), plus prompt positions of
requests that asked for prompt logprobs.

Speculative decoding: a request scheduled for its last token plus its draft tokens
(``spec_token_ids``) is a verification. It runs as one decode row per token (row i at
position ``num_computed_tokens + i``, attending to ``num_computed_tokens + i + 1`` tokens:
all rows write their K/V before any attends, so this is the causal chunk), needs logits at
every row, and is verified by :func:`kvserve.spec_decode.rejection_sample`. Over 2-/4-bit pools
(:mod:`kvserve.worker.kv_quant_lowbit`) a verification that fills a block it has rows before the
block's last slot in runs as a prefill chunk instead (with logits at every row): decode rows read a
block the step fills quantized, while those rows must see it in the model dtype, as one-token
decoding would have shown them (:func:`kvserve.worker.attention.prefill_lowbit` masks each row).

KV compression (:mod:`kvserve.core.kv_compression`): a token's position (RoPE) and its KV index
(its slot in the block table, what attention counts) differ by the request's
``num_dropped_tokens`` once a compaction dropped tokens; positions continue from the true
sequence position, slots and context lengths from the KV length. Requests whose policy needs
attention scores (SnapKV, H2O) get :class:`~kvserve.worker.attention.KVProbe` rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kvserve.worker.attention import AttentionMetadata, KVProbe, PrefillSegment
from kvserve.core.request import Request, TokenLogprob
from kvserve.sample.sampler import (Sampler, SamplerOutput, SamplingMetadata, SamplingRow, TokenHistory, compute_logprobs,
                                    plain_greedy)
from kvserve.core.scheduler import SchedulerOutput
from kvserve.structured_output.manager import grammar_bitmask, speculative_bitmask
from kvserve.spec_decode.rejection_sampler import DraftBatch, rejection_sample


def token_slice(req: Request, start: int, end: int) -> list[int]:
    """Token ids ``[start, end)`` of prompt + output + draft tokens without building the
    full list."""
    if end > req.num_tokens:  # a speculative verification: the drafts follow the output
        n = req.num_tokens
        return (token_slice(req, start, n) if start < n else []) + req.spec_token_ids[max(start - n, 0) : end - n]
    p = req.prompt_token_ids
    n = len(p)
    if end <= n:
        return p[start:end]
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    return p[start:] + req.output_token_ids[: end - n]


def _fills_block_midway(first: int, n: int, block_size: int) -> bool:
    """Whether rows ``[first, first + n)`` fill a block (write its last slot) in which they also have
    a row before that slot: the first block end at or after ``first + 1`` lies before ``first + n``."""
    end1 = first + 1 + (block_size - 1 - (first + 1)) % block_size  # first e >= first + 1 with e % bs == bs - 1
    return end1 <= first + n - 1


@dataclass
class BatchInputs:
    """The tensors of one step (see the module docstring)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]
    sample_rows: list[int]
    prompt_logprob_spans: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # (request, first logits row, number of rows, first prompt position whose next token is scored)
    spec_requests: list[Request] = field(default_factory=list)  # verifications, in row order
    spec_rows: list[int] = field(default_factory=list)  # their logits rows (1 + drafts each)


@dataclass
class SpecResult:
    """A speculative verification's outcome for one request.

    Attributes:
        token_ids: the accepted drafts then the correction/bonus token (1..k + 1 tokens).
        logprobs: one :class:`TokenLogprob` per token (raw distribution at its position).
        num_drafts: drafts verified (k).
        num_accepted: drafts accepted (``len(token_ids) - 1``).
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    num_drafts: int
    num_accepted: int


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the requests that sampled this step.

    Attributes:
        sample_requests: requests that got a new token, in row order.
        sampler_output: the sampler's tensors, row i for ``sample_requests[i]``.
        prompt_logprobs: request id → logprobs of the prompt positions computed this step.
    """

    sample_requests: list[Request]
    sampler_output: Optional[SamplerOutput]
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    beam_topk: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    spec: dict[str, SpecResult] = field(default_factory=dict)  # request id → its verification

    @staticmethod
    def merge(parts: list["ModelRunnerOutput"]) -> "ModelRunnerOutput":
        """One output for steps run piecewise (disjoint requests), rows in the order of ``parts``."""
        out = ModelRunnerOutput(sample_requests=[r for p in parts for r in p.sample_requests], sampler_output=None)
        sampled = [p.sampler_output for p in parts if p.sampler_output is not None]
        if sampled:
            out.sampler_output = SamplerOutput.cat(sampled)
        for p in parts:
            out.prompt_logprobs.update(p.prompt_logprobs)
            out.beam_topk.update(p.beam_topk)
            out.spec.update(p.spec)
        return out


class ModelRunner:
    """Runs the model over the paged cache.

    Args:
        model: a model with the ``forward(input_ids, positions, kv_caches, meta, logits_indices)``
            signature of :class:`kvserve.worker.models.llama.LlamaForCausalLM`.
        kv_caches: per-layer (K, V) pools.
        block_tables: the KV manager's ``request_id → block ids`` map (read only).
        block_size: tokens per block.
        device: where the batch tensors go.
        sliding_window: the window (tokens) of a model whose every layer is windowed, whose
            blocks before the window the KV manager frees (their table entries are -1), or
            None. The decode rows then get block tables and context lengths (windowed
            attention reads only the window) and no gathered context, which would cover freed
            blocks.
    """

    def __init__(self, model, kv_caches, block_tables: dict[str, list[int]], block_size: int,
                 device: torch.device, sliding_window: Optional[int] = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_tables = block_tables
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.compressor = None  # the worker's KVCompressor (kv_block_mover), for compression scores
        self.residual_map: Optional[torch.Tensor] = None  # 2-/4-bit pools: block → residual slot (KV manager's)
        backend = getattr(model, "attn_backend", None)
        self.uses_context_slots = getattr(backend, "uses_context_slots", True) and sliding_window is None

    # ---------------------------------------------------------------- inputs
    def prepare_inputs(self, sched: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        decodes = [(r, n) for r, n in sched.scheduled if n == 1]
        # a verification (last token + drafts) runs as n decode rows of one sequence: row i at
        # position nc + i with context nc + i + 1 (every row's K/V is written before any row
        # attends), so it batches with the decodes and takes the one-call C decode step
        verify = [(r, n) for r, n in sched.scheduled
                  if n > 1 and r.spec_token_ids and r.num_computed_tokens + n == r.num_tokens_with_spec]
        verifying = {r.request_id for r, _ in verify}
        # 2-/4-bit pools: a verification that fills a block it has more than one row in runs as a
        # masked causal chunk instead (the decode rows before the block's last slot would read the
        # block quantized, attention.prefill_lowbit gives each its own block in the model dtype)
        chunked = {r.request_id for r, n in verify if self.residual_map is not None
                   and _fills_block_midway(r.num_computed_tokens - r.num_dropped_tokens, n, bs)}
        verify = [(r, n) for r, n in verify if r.request_id not in chunked]
        prefills = [(r, n) for r, n in sched.scheduled
                    if n > 1 and (r.request_id not in verifying or r.request_id in chunked)]
        ids: list[int] = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        logits_idx: list[int] = []
        sample_reqs: list[Request] = []
        sample_rows: list[int] = []
        pl_spans: list[tuple[Request, int, int, int]] = []
        spec_reqs: list[Request] = []
        spec_rows: list[int] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))

        def maybe_sample(req: Request, last_index: int, n: int) -> None:
            if req.num_computed_tokens + n == req.num_tokens:
                sample_rows.append(len(logits_idx))
                logits_idx.append(last_index)
                sample_reqs.append(req)

        rows = [(r, 0) for r, _ in decodes] + [(r, i) for r, n in verify for i in range(n)]
        if rows:
            D = len(rows)
            tables = [self.block_tables[r.request_id] for r, _ in rows]
            max_blocks = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
            # positions, KV indices (position - dropped tokens: 0 unless the request's KV was
            # compacted) and slots as Python ints, then one tensor: right after a decode step has
            # streamed the weights through the caches each PyTorch op costs tens of microseconds
            nc_l = [r.num_computed_tokens + i for r, i in rows]
            kv_l = [p - r.num_dropped_tokens for p, (r, _) in zip(nc_l, rows)]
            slot_l = [t[k // bs] * bs + k % bs for t, k in zip(tables, kv_l)]
            nc, slots, ctx_len = torch.tensor([nc_l, slot_l, [k + 1 for k in kv_l]], dtype=torch.long).unbind(0)
            max_ctx = max(kv_l) + 1
            meta.num_decode_tokens = D
            meta.decode_max_context_len = max_ctx
            if self.uses_context_slots:
                grid = torch.arange(max_ctx, dtype=torch.long)
                ctx_slots = bt.gather(1, (grid // bs).expand(D, -1)) * bs + grid % bs
                valid = grid.unsqueeze(0) < ctx_len.unsqueeze(1)
                meta.decode_context_slots = torch.where(valid, ctx_slots, 0).to(self.device)
                meta.decode_mask = valid.view(D, 1, 1, max_ctx).to(self.device)
            # (the SDPA backend reads these for windowed layers: their windows alone)
            meta.decode_block_tables = bt.to(self.device)
            meta.decode_context_lens = ctx_len.to(self.device)
            pos_parts.append(nc)
            slot_parts.append(slots)
            probe_rows = [(r, i, 1) for i, (r, _) in enumerate(decodes)]
            row = len(decodes)
            for r, n in verify:
                probe_rows.append((r, row, n))
                row += n
            for i, (r, n) in enumerate(decodes):
                nc1 = r.num_computed_tokens
                ids.append(token_slice(r, nc1, nc1 + 1)[0])
                if r.sampling_params.prompt_logprobs is not None and nc1 < r.num_prompt_tokens - 1:
                    # a one-token prefill chunk (it runs as a decode): its row scores the next prompt token
                    pl_spans.append((r, len(logits_idx), 1, nc1))
                    logits_idx.append(i)
                maybe_sample(r, i, 1)
            row = len(decodes)
            for r, n in verify:
                nc1 = r.num_computed_tokens
                ids.extend(token_slice(r, nc1, nc1 + n))
                spec_reqs.append(r)
                spec_rows.extend(range(len(logits_idx), len(logits_idx) + n))
                logits_idx.extend(range(row, row + n))
                row += n

        start = len(ids)
        if not rows:
            probe_rows = []
        for r, n in prefills:
            nc = r.num_computed_tokens
            k0 = nc - r.num_dropped_tokens  # the chunk's first KV index (its position is nc)
            ids.extend(token_slice(r, nc, nc + n))
            table = torch.tensor(self.block_tables[r.request_id], dtype=torch.long)
            ctx_pos = torch.arange(k0 + n, dtype=torch.long)  # KV indices of the context
            ctx_slots = table[ctx_pos // bs] * bs + ctx_pos % bs
            pos_parts.append(torch.arange(nc, nc + n, dtype=torch.long))
            slot_parts.append(ctx_slots[k0:])
            probe_rows.append((r, start, n))
            seg = PrefillSegment(start=start, end=start + n, num_past=k0)
            if k0 > 0:
                seg.context_slots = ctx_slots.to(self.device)
                q_pos = ctx_pos[k0:].unsqueeze(1)
                seg.causal_mask = (ctx_pos.unsqueeze(0) <= q_pos).to(self.device)
            meta.prefills.append(seg)
            if r.request_id in chunked:  # a verification: logits at every row, no sampling here
                spec_reqs.append(r)
                spec_rows.extend(range(len(logits_idx), len(logits_idx) + n))
                logits_idx.extend(range(start, start + n))
                start += n
                continue
            want_pl = r.sampling_params.prompt_logprobs is not None
            if want_pl and nc < r.num_prompt_tokens - 1:
                # rows whose next token is a prompt token: positions nc .. min(nc+n, P-1) - 1
                last = min(nc + n, r.num_prompt_tokens - 1)
                pl_spans.append((r, len(logits_idx), last - nc, nc))
                logits_idx.extend(range(start, start + last - nc))
            maybe_sample(r, start + n - 1, n)
            start += n

        if prefills and not self.uses_context_slots:
            tables = [self.block_tables[r.request_id] for r, _ in prefills]
            width = max(len(t) for t in tables)
            meta.prefill_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                     dtype=torch.long, device=self.device)
            meta.prefill_chunks = torch.tensor([[seg.start, seg.end - seg.start, seg.num_past]
                                                for seg in meta.prefills], dtype=torch.long, device=self.device)
        meta.slot_mapping = (slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts)).to(self.device)
        rmap = self.residual_map
        if rmap is not None and rmap.device != torch.device(self.device):  # (the KV manager's is on the CPU)
            rmap = rmap.to(self.device)
        meta.residual_map = rmap
        meta.kv_probes = self._kv_probes(probe_rows, verifying)
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=(pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)).to(self.device),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=self.device),
            sample_requests=sample_reqs,
            sample_rows=sample_rows,
            prompt_logprob_spans=pl_spans,
            spec_requests=spec_reqs,
            spec_rows=spec_rows,
        )

    def _kv_probes(self, rows: list[tuple[Request, int, int]], verifying: set[str]) -> list[KVProbe]:
        """The :class:`KVProbe` of each request whose KV compression needs attention scores
        (``rows``: request, first batch row, rows): H2O's every query; SnapKV's queries at positions
        ``≥ num_tokens - observation_window`` while its prompt (prompt + output, when recomputed)
        has not been compressed yet. A verification (``verifying``: its last token and drafts)
        gets one probe per row, marked ``verify``: the compressor keeps them aside until it knows
        which drafts were accepted (:meth:`~kvserve.worker.kv_compressor.KVCompressor.accumulate`)."""
        bs = self.block_size
        probes = []
        for r, row0, n in rows:
            cfg = r.kv_compression
            if cfg is None or not cfg.uses_scores:
                continue
            p0 = r.num_computed_tokens  # position of row0
            lo = 0
            if cfg.method == "snapkv":
                if r.kv_prompt_compressed:
                    continue
                lo = max(0, r.num_tokens - cfg.observation_window - p0)
                if lo >= n:
                    continue
            k0 = p0 - r.num_dropped_tokens
            c = k0 + n
            table = torch.tensor(self.block_tables[r.request_id], dtype=torch.long)
            ctx = torch.arange(c, dtype=torch.long)
            slots = (table[ctx // bs] * bs + ctx % bs).to(self.device)
            spans = [(i, i + 1) for i in range(lo, n)] if r.request_id in verifying else [(lo, n)]
            for a, b in spans:
                probes.append(KVProbe(
                    request_id=r.request_id,
                    rows=torch.arange(row0 + a, row0 + b, dtype=torch.long, device=self.device),
                    query_kv=torch.arange(k0 + a, k0 + b, dtype=torch.long, device=self.device),
                    context_slots=slots[: k0 + b],
                    num_dropped=r.num_dropped_tokens, verify=r.request_id in verifying, num_cached=k0))
        return probes

    # --------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                before_forward: Optional[Callable[[BatchInputs], None]] = None) -> ModelRunnerOutput:
        """Run one step: forward over every scheduled token, then sample (rows of sequences with a
        structured-output grammar under its token bitmask). ``before_forward(batch)`` runs once
        the batch tensors are built (the tensor-parallel driver sends them to the other ranks)."""
        batch = self.prepare_inputs(sched)
        if before_forward is not None:
            before_forward(batch)
        logits = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, batch.logits_indices)
        if batch.meta.kv_probes and self.compressor is not None:
            self.compressor.accumulate(batch.meta)
        if logits is None:  # a tensor-parallel rank the logits are not gathered to: nothing to sample
            return ModelRunnerOutput(sample_requests=[], sampler_output=None)
        out = ModelRunnerOutput(sample_requests=batch.sample_requests, sampler_output=None)
        sample_logits = logits
        if batch.prompt_logprob_spans:
            out.prompt_logprobs = self._prompt_logprobs(logits, batch)
        if batch.prompt_logprob_spans or batch.spec_requests:
            sample_logits = logits[torch.tensor(batch.sample_rows, dtype=torch.long, device=logits.device)]
        if batch.spec_requests:
            spec_logits = logits[torch.tensor(batch.spec_rows, dtype=torch.long, device=logits.device)]
            out.spec = self._verify(spec_logits, batch.spec_requests)
        if batch.sample_requests and all(r.grammar is None and not r.sampling_params.use_beam_search
                                         and plain_greedy(r.sampling_params, len(r.output_token_ids))
                                         for r in batch.sample_requests):
            # every row takes the bare argmax: the sampler's own fast path, without its rows and metadata
            out.sampler_output = self.sampler.greedy(sample_logits)
        if batch.sample_requests and out.sampler_output is None:
            rows = [
                SamplingRow(
                    params=r.sampling_params,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids,
                    seed=r.seed,
                    eos_token_id=list(r.eos_token_ids),
                    history=TokenHistory.attach(r),
                )
                for r in batch.sample_requests
            ]
            # structured output: the token bitmasks of the rows that follow a grammar
            g_rows = [i for i, r in enumerate(batch.sample_requests) if r.grammar is not None]
            g_mask = grammar_bitmask([batch.sample_requests[i].grammar for i in g_rows]) if g_rows else None
            meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device, g_rows, g_mask)
            out.sampler_output = self.sampler(sample_logits, meta)
            beam_rows = [i for i, r in enumerate(batch.sample_requests) if r.sampling_params.use_beam_search]
            if beam_rows:
                out.beam_topk = self._beam_topk(sample_logits, batch.sample_requests, beam_rows)
        return out

    def _verify(self, logits: torch.Tensor, reqs: list[Request]) -> dict[str, SpecResult]:
        """Rejection-sample the drafts of ``reqs`` (logits [sum(k + 1), V], each request's rows
        in order of position) → request id → :class:`SpecResult`. A request with a grammar has
        each of its rows under the grammar's mask at that position
        (:func:`~kvserve.structured_output.manager.speculative_bitmask`), so its target p is the masked
        distribution; its matcher is left as it was (the engine advances it by the tokens kept)."""
        rows = []
        for r in reqs:
            p = r.sampling_params
            penalized = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            hist = TokenHistory.attach(r).sync(r.prompt_token_ids, r.output_token_ids) if penalized else None
            for i in range(len(r.spec_token_ids) + 1):
                # row i sees the output followed by the first i drafts (penalties, bad words,
                # min_tokens and the seed's step all count them)
                out_i = r.output_token_ids if i == 0 else r.output_token_ids + r.spec_token_ids[:i]
                rows.append(SamplingRow(params=p, prompt_token_ids=r.prompt_token_ids, output_token_ids=out_i,
                                        seed=r.seed, eos_token_id=list(r.eos_token_ids),
                                        history=None if hist is None else (hist if i == 0 else hist.extended(out_i))))
        # structured output: one bitmask row per verified position of the constrained requests
        # (row i: the grammar's state after the first i drafts), all in one [G, W] tensor
        g_reqs, g_rows, row0 = [], [], 0
        for r in reqs:
            n = len(r.spec_token_ids) + 1
            if r.grammar is not None:
                g_reqs.append(r)
                g_rows.extend(range(row0, row0 + n))
            row0 += n
        g_mask = None
        if g_reqs:
            g_mask = speculative_bitmask([r.grammar for r in g_reqs], [r.spec_token_ids for r in g_reqs],
                                         [r.grammar.valid_prefix(r.spec_token_ids) for r in g_reqs])
        meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device, g_rows, g_mask)
        drafts = DraftBatch(
            num_drafts=[len(r.spec_token_ids) for r in reqs],
            draft_token_ids=[list(r.spec_token_ids) for r in reqs],
            draft_probs=[r.spec_draft_probs for r in reqs],
            seeds=[r.seed for r in reqs],
            num_output_tokens=[len(r.output_token_ids) for r in reqs],
        )
        so = rejection_sample(logits, meta, drafts)
        lps, ranks = so.logprobs.tolist(), so.ranks.tolist()
        top_ids = so.top_token_ids.tolist() if so.top_token_ids is not None else None
        top_lps = so.top_logprobs.tolist() if so.top_logprobs is not None else None
        res = {}
        for j, r in enumerate(reqs):
            k = r.sampling_params.logprobs
            o = so.row_offsets[j]
            toks = so.token_ids[j]
            res[r.request_id] = SpecResult(
                token_ids=toks,
                logprobs=[TokenLogprob(t, lps[o + i], ranks[o + i],
                                       list(zip(top_ids[o + i][:k], top_lps[o + i][:k])) if (k and top_ids) else [])
                          for i, t in enumerate(toks)],
                num_drafts=len(r.spec_token_ids),
                num_accepted=so.num_accepted[j],
            )
        return res

    @staticmethod
    def _beam_topk(logits, reqs, rows) -> dict[str, tuple[list[int], list[float]]]:
        """Per beam row, the 2·beam_width most likely next tokens and their raw logprobs."""
        k = 2 * max(reqs[i].sampling_params.beam_width for i in rows)
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        top_lp, top_ids = torch.topk(torch.log_softmax(logits[idx].float(), dim=-1), k, dim=-1)
        ids, lps = top_ids.tolist(), top_lp.tolist()
        return {reqs[i].request_id: (ids[j], lps[j]) for j, i in enumerate(rows)}

    def _prompt_logprobs(self, logits: torch.Tensor, batch: BatchInputs) -> dict[str, list[TokenLogprob]]:
        res: dict[str, list[TokenLogprob]] = {}
        for req, row0, n, p0 in batch.prompt_logprob_spans:
            targets = torch.tensor(req.prompt_token_ids[p0 + 1 : p0 + 1 + n], dtype=torch.long, device=logits.device)
            k = req.sampling_params.prompt_logprobs or 0
            lp, rank, top_ids, top_lp = compute_logprobs(logits[row0 : row0 + n], targets, k)
            lp, rank = lp.tolist(), rank.tolist()
            tids = top_ids.tolist() if k else [[] for _ in range(n)]
            tlps = top_lp.tolist() if k else [[] for _ in range(n)]
            res[req.request_id] = [
                TokenLogprob(int(t), lp[i], rank[i], list(zip(tids[i], tlps[i])))
                for i, t in enumerate(targets.tolist())
            ]
        return res
