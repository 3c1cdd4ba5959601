"""vLLM's offline ``LLM.generate`` on a given workload: the vLLM row of benchmarks/throughput.py.

Runs in vLLM's own venv (benchmarks/peers/install_vllm_cpu.sh), started by throughput.py as a
subprocess with the environment of benchmarks/peers/vllm_env.sh; it imports nothing of kvserve.

Input, a JSON file (``--workload``): ``model`` (a Hugging Face folder), ``dtype``,
``prompts`` (lists of token ids), ``outs`` (output lengths, EOS ignored), ``max_model_len``,
``max_num_seqs``, and optionally ``single_prompt`` (token ids) and ``single_n_out``.
Output: the same figures as throughput.py's kvserve run, as JSON in ``--out`` and on the last
line of stdout after ``VLLM_RESULT ``:
``{"vllm": {"seconds", "output_tokens", "output_tok_s", "total_tok_s"}, "vllm_single":
{"ttft_s", "decode_tok_s"}, "startup_s", "version"}``.

Greedy decoding, prefix caching off (as kvserve's run); a warm-up of 4 output tokens per request
first. Single stream: vLLM's offline LLM keeps no per-request timestamps (its stats are off), so
TTFT is the wall time of a 1-token generate and decode tok/s is (n - 1) / (t(n) - t(1)) over
an n-token generate of the same prompt; throughput.py measures kvserve the same way for the
ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, help="the JSON workload file")
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--memory-utilization", type=float, default=0.25,
                    help="vLLM's gpu_memory_utilization, on CPU the share of the machine's memory it checks is "
                         "free at start (default 0.25: the memory here is shared; the KV cache itself is "
                         "VLLM_CPU_KVCACHE_SPACE GiB)")
    ap.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    a = ap.parse_args(argv)
    w = json.load(open(a.workload))
    if len(w["prompts"]) != len(w["outs"]):
        print(f"error: workload has {len(w['prompts'])} prompts but {len(w['outs'])} outs", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=w["model"], dtype=w["dtype"], max_model_len=w["max_model_len"],
              max_num_seqs=w["max_num_seqs"], enable_prefix_caching=False, seed=0,
              enforce_eager=a.enforce_eager, gpu_memory_utilization=a.memory_utilization)
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    llm.generate(prompts, [params(4) for _ in prompts], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    res = llm.generate(prompts, [params(m) for m in w["outs"]], use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    if n_out != sum(w["outs"]):
        print(f"error: vLLM produced {n_out} tokens, the workload asks for {sum(w['outs'])}", file=sys.stderr)
        return 1
    n_in = sum(map(len, w["prompts"]))
    result = {"version": vllm.__version__, "startup_s": startup,
              "vllm": {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
                       "total_tok_s": (n_out + n_in) / dt}}
    if w.get("single_prompt"):
        p = [TokensPrompt(prompt_token_ids=w["single_prompt"])]
        n = int(w.get("single_n_out", 128))
        llm.generate(p, params(8), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(p, params(1), use_tqdm=False)
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(p, params(n), use_tqdm=False)
        tn = time.perf_counter() - t0
        result["vllm_single"] = {"ttft_s": t1, "decode_tok_s": (n - 1) / max(tn - t1, 1e-9)}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print("VLLM_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
