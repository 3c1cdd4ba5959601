"""Tensor parallelism against transformers (issue #19): tiny random Llama, Qwen2, Qwen3, Mistral
(also with a 16-token sliding window) and Gemma 3 (sandwich norms, local and global layers, an
8-token window), built with transformers in the tests, split over 2 and 4 gloo ranks in spawned
processes (tests/tp_harness.py; 4 ranks on 2 cores: slow, but the models are tiny).

Each model has 4 query heads and 2 KV heads: at TP = 2 a rank holds 2 query heads and 1 KV
head; at TP = 4, 1 query head and 1 KV head, each KV head replicated on 2 ranks (as vLLM does).
In float32, with the logits gathered to rank 0 (as the engine's driver has them):

* a 40-token prompt in one prefill through the paged KV cache: every position's logits equal
  transformers' within 1e-4;
* three prompts (19, 2 and 7 tokens) run together, prefill chunked (5 tokens a step) and
  batched with the others' decodes, then 16 greedy tokens each through the paged cache: the
  tokens are transformers' ``generate(do_sample=False)`` ones, and every row of logits (the
  last prompt position, then each decode step) equals transformers' logits at that position
  within 1e-4. The sequences (35, 18 and 23 tokens) run past the 16- and 8-token windows.
"""

import pytest
import torch

from tp_harness import drive_worker

#: 19 + 16 tokens: past mistral_window's 16-token window and Gemma 3's 8
PROMPTS = [[5, 17, 99, 3, 250, 40, 41, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [300, 301], [77] * 7]
MAX_NEW = 16
FULL = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(1)).tolist()
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mistral_window", "gemma3"]
#: TP = 2 first: one pool of each size at a time is alive for most of the module
CASES = [(tp, arch) for tp in (2, 4) for arch in ARCHS]


def _rank_job(folder: str, prompts: list[list[int]], max_new: int, full_ids: list[int]) -> dict:
    """(A rank job.) This rank's Worker: :func:`tp_harness.drive_worker` over ``prompts`` with
    the logits gathered to rank 0, then one prefill of ``full_ids`` with every position's logits
    (``"prefill"``; None on the other ranks)."""
    from kvserve.distributed import get_tp_rank, get_tp_world_size
    from kvserve.worker.attention import AttentionMetadata, PrefillSegment
    from kvserve.worker.worker import Worker

    w = Worker(torch.float32, torch.device("cpu"), get_tp_rank(), get_tp_world_size(), "joined://")
    out = drive_worker(w, folder, prompts, max_new, logits_dst=0)
    T = len(full_ids)  # (the pool's first blocks, free again: 27 blocks of 4 tokens)
    pos = torch.arange(T)
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSegment(0, T, 0)])
    with torch.inference_mode():
        out["prefill"] = w.model(torch.tensor(full_ids), pos, w.kv_caches, meta, pos)
    return out


@pytest.mark.parametrize("tp, arch", CASES, ids=[f"tp{tp}-{arch}" for tp, arch in CASES])
def test_tp_matches_transformers(tiny_model_dir, tp_pool, tp, arch):
    folder, hf = tiny_model_dir(arch)
    ranks = tp_pool(tp).run(_rank_job, str(folder), PROMPTS, MAX_NEW, FULL, timeout_s=300)
    for out in ranks:  # the heads each rank holds (KV replicated on 2 ranks at TP = 4)
        assert (out["num_heads"], out["kv_heads"]) == (4 // tp, 1)
    rank0 = ranks[0]
    assert all(out["prefill"] is None and out["logits"] == [] for out in ranks[1:])  # gathered to rank 0

    with torch.no_grad():
        ref = hf(torch.tensor([FULL])).logits[0]
    assert rank0["prefill"].shape == ref.shape
    torch.testing.assert_close(rank0["prefill"], ref, atol=1e-4, rtol=0)

    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
        for out in ranks:  # (rank 0 samples; the others follow its broadcast tokens)
            assert out["tokens"][i] == want, (i, out["tokens"][i], want)
    seqs = [p + t for p, t in zip(PROMPTS, rank0["tokens"])]
    with torch.no_grad():
        full = [hf(torch.tensor([s])).logits[0] for s in seqs]
    checked = 0
    for step_logits, rows in zip(rank0["logits"], rank0["rows"], strict=True):
        assert step_logits.shape[0] == len(rows)
        for row, (i, position) in zip(step_logits, rows):
            torch.testing.assert_close(row, full[i][position], atol=1e-4, rtol=0)
            checked += 1
    assert checked == len(PROMPTS) * MAX_NEW  # every sampled token's logits
