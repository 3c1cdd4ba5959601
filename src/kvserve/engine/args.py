"""Engine arguments: :class:`EngineArgs` (what builds an engine) and the device/dtype parsers.

Every range check that needs no model runs in :meth:`EngineArgs.check`, before any weight is
read, so a bad option fails in milliseconds with an error naming the field.
"""

from __future__ import annotations

import argparse
import numbers
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from kvserve.core.kv_cache_manager import DEFAULT_KV_CACHE_MEMORY_FRACTION
from kvserve.core.kv_offload import check_offload_options
from kvserve.core.kv_compression import KVCompressionConfig
from kvserve.core.kv_swap import check_swap_options
from kvserve.spec_decode import SpeculativeConfig
from kvserve.worker import kv_quant
from kvserve.worker.layers.linear import GGUF_QUANTIZATIONS, QUANTIZATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_device(device: Optional[str]) -> torch.device:
    """``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` → device.

    Raises:
        ValueError: an unknown device string, or CUDA asked for where it is not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available: this PyTorch build or machine has no CUDA GPU")
    if dev.type == "cuda" and dev.index is not None and not dev.index < torch.cuda.device_count():
        raise ValueError(f"device {device!r} is not available: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return dev


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` or a torch dtype → torch dtype.

    Raises:
        ValueError: for any other value.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


@dataclass
class EngineArgs:
    """Everything needed to build an engine.

    Attributes:
        model: GGUF file or Hugging Face folder; None for the default SmolLM2.
        dtype: weights, activations and (with ``kv_cache_dtype="auto"``) KV cache dtype.
        kv_cache_dtype: ``"auto"`` (the model dtype), ``"int8"``, or ``"fp8"``/``"fp8_e4m3"``: 8-bit
            K/V with a float32 scale per token and KV head (:mod:`kvserve.worker.kv_quant`), ~1.9x the
            tokens in the same ``kv_cache_memory``; ``"int4"``/``"int2"``: KIVI's 4-/2-bit K/V (keys
            per channel over each block, values per token in groups of 32 channels, partial blocks in
            the model dtype: :mod:`kvserve.worker.kv_quant_lowbit`), ~2.9x / ~4.6x the tokens of bf16
            at head_dim 64 and block_size 16; with the disk tier, swap preemption and a KV connector
            (they move the packed blocks; a swap also a partial block's model-dtype rows, a
            transfer leaves the prompt's last partial block to the decode engine), tensor
            parallelism, KV compression (the kept tokens requantized into the new blocks:
            :mod:`kvserve.worker.kv_compressor`) and speculative decoding (a block a verification
            fills is sealed once its rows are all accepted; a draft model's pool is int8), also the
            last two together.
        device: "cpu", "cuda" or None (CUDA when available).
        kv_cache_memory: KV pool budget in GiB; None (default): ``kv_cache_memory_fraction`` of the
            memory available once the model is loaded, at most 2 GiB and at least one
            ``max_model_len`` sequence (:func:`kvserve.core.kv_cache_manager.default_kv_cache_memory`).
        kv_cache_memory_fraction: with ``kv_cache_memory=None``, the share of the available memory
            (``MemAvailable`` on a CPU, free memory on CUDA) given to the KV pool, in (0, 1]
            (default 0.5); ignored when ``kv_cache_memory`` or ``num_blocks`` is set.
        num_gpu_blocks / num_blocks: explicit pool size (overrides the budget).
        block_size: tokens per KV block.
        max_model_len: longest sequence in tokens (default: min(model's context, 4096)).
        max_num_batched_tokens: per-step token budget.
        max_num_seqs: most running sequences.
        max_waiting: most requests waiting to start (none of their sequences scheduled yet;
            preempted requests and forked samples do not count) before new ones are refused
            with ``QueueFullError`` (0: unbounded, offline's default; ``kvserve serve``'s is
            ``4 × max_num_seqs``).
        max_num_seqs_per_user: the most sequences (samples of ``n`` count) one user
            (``Request.user``) runs at once: the rest of its samples and requests wait, so that
            one user's burst cannot make every step large (a step's time grows with its batch);
            a beam search wider than it is refused. ``None`` (default): no cap, only the fair
            share of slots between users.
        enable_prefix_caching: reuse cached prompt KV (off for models whose every layer has a
            sliding window, whose blocks before the window are freed instead).
        quantization: ``"auto"`` (default): ``"gguf"`` for a GGUF file, None for a Hugging Face
            folder (:func:`resolve_quantization`). ``"gguf"``: a GGUF file's
            Q4_0/Q4_1/Q5_0/Q8_0/Q2_K-Q6_K tensors stay quantized (linear layers, embedding, LM
            head; see :mod:`kvserve.worker.layers.quant`; no effect on other tensor types or off
            the CPU), ``"gguf_int8"`` too with int8 activations; both need a GGUF file (a
            ValueError at load otherwise). None (``"none"``): dequantize to the model dtype at
            load; ``"int8"``: weight-only int8 linears; ``"int4"``: the linear layers' float
            weights quantized at load to group-wise asymmetric int4 (a float32 scale and minimum
            per 32 input values, gpt-fast's/torchao's scheme; ``"int4_g16"``, ``"int4_g64"``,
            ``"int4_g128"``, ``"int4_g256"``: per 16 ... 256), run on the weight-only kernel; the
            embedding and LM head stay in the model dtype.
        seed: seed for the random seeds of unseeded requests.
        speculative_config: None, or speculative decoding as a dict (or its JSON text):
            ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1}`` or ``{"method": "draft_model", "model": PATH,
            "num_speculative_tokens": k}`` (see :class:`kvserve.spec_decode.SpeculativeConfig`).
        swap_space: GiB of host memory for the KV blocks of preempted requests
            (:mod:`kvserve.core.kv_swap`), in [0, 1048576]; 0 (default): none.
        preemption_mode: what preemption does with a victim's KV: ``"recompute"`` (free it,
            recompute prompt + output when resumed) or ``"swap"`` (copy it to the host pool and
            back; needs ``swap_space > 0``). None (default): ``"swap"`` when ``swap_space > 0``,
            else ``"recompute"``. Recompute is the default because it costs no memory up front,
            prefix caching often serves most of a resumed request's context anyway, and on a CPU
            the "device" pool is host RAM too (memory given to swap_space could as well enlarge
            ``kv_cache_memory``); swap pays where recomputing long contexts is slow next to
            copying them (vLLM v0: 4 GiB of swap space, recompute unless a group needed swap).
        tensor_parallel_size: ranks that each hold 1/N of every layer (Megatron-style tensor
            parallelism over ``torch.distributed``: gloo on CPU, NCCL on CUDA), in
            [1, the cores available] on a CPU (the ranks split the cores). 1: one process.
        distributed_executor_backend: how the ranks run: ``"mp"`` (processes on this machine,
            the default) or ``"ray"`` (Ray actors in a placement group, on one machine or a
            cluster: :mod:`kvserve.executor.ray_executor`; a local Ray instance is started
            unless this process is connected to Ray already or ``RAY_ADDRESS`` names a
            cluster, which must be reachable). None: ``"mp"``. At ``tensor_parallel_size=1``
            the worker runs in the engine's process whatever the backend.
        distributed_timeout_s: how long a rank may take to answer, or a collective to meet,
            before the step fails (seconds, > 0).
        kv_connector: how this engine hands prompt K/V to, or takes it from, another engine
            (prefill/decode disaggregation, :mod:`kvserve.distributed.kv_transfer`): ``"local"``
            (engines in one process), ``"ray"`` (Ray's object store: engines in processes of one
            Ray cluster), or None (no transfer; requests with ``kv_transfer_params`` are refused).
        kv_offload_dir: a directory for the prefix cache's disk tier (:mod:`kvserve.core.kv_offload`):
            full blocks evicted from memory are written there and read back when a later prompt's
            prefix continues past what memory holds; the files outlive the engine (a restarted
            engine finds them). Created if missing; must be writable. None (default): no disk tier.
        kv_offload_gib: the disk tier's size in GiB, in (0, 1048576] (least recently used files
            are deleted beyond it); needed with ``kv_offload_dir``. With tensor parallelism each rank
            writes and reads its own shard of a block (one file per block and rank).
        kv_compression: the KV compression policy of requests that set none, as a dict (or its
            JSON text): ``{"method": "streaming_llm", "sink_tokens": 4, "window": W}``,
            ``{"method": "snapkv", "budget": B, "observation_window": 32, "kernel_size": 7}`` or
            ``{"method": "h2o", "budget": B, "recent": R}`` (:mod:`kvserve.core.kv_compression`);
            None keeps every request's KV whole.
    """

    model: Optional[str] = None
    dtype: str | torch.dtype = "bfloat16"
    kv_cache_dtype: str = "auto"
    device: Optional[str] = None
    kv_cache_memory: Optional[float] = None
    kv_cache_memory_fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION
    num_blocks: Optional[int] = None
    block_size: int = 16
    max_model_len: Optional[int] = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_waiting: int = 0
    max_num_seqs_per_user: Optional[int] = None
    enable_prefix_caching: bool = True
    quantization: Optional[str] = "auto"
    seed: Optional[int] = None
    speculative_config: Optional[Union[dict, str, SpeculativeConfig]] = None
    swap_space: float = 0.0
    preemption_mode: Optional[str] = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None
    distributed_timeout_s: float = 120.0
    kv_connector: Optional[str] = None
    kv_offload_dir: Optional[str] = None
    kv_offload_gib: Optional[float] = None
    kv_compression: Optional[Union[dict, str, KVCompressionConfig]] = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """``parser`` with the engine options of ``kvserve generate``/``serve`` (``--model``,
        ``--dtype``, ``--kv-cache-memory``, ...) added; returns it (vLLM's
        ``EngineArgs.add_cli_args``)."""
        from kvserve.entrypoints.cli import _add_engine_args

        _add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The engine arguments of options parsed by a parser from :meth:`add_cli_args` (vLLM's
        ``EngineArgs.from_cli_args``); not range-checked yet (:meth:`check`)."""
        from kvserve.entrypoints.cli import _engine_kwargs

        return cls(model=args.model, dtype=args.dtype, **_engine_kwargs(args))

    def check(self, option_names: bool = False) -> None:
        """The range checks that need no model; :class:`LLMEngine` runs them before it loads one.

        Args:
            option_names: name the fields as command-line options (``--max-model-len``).

        Raises:
            ValueError: naming the first field out of range and its allowed range.
        """
        def name(field: str) -> str:
            return "--" + field.replace("_", "-") if option_names else field

        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        for field, optional in (("block_size", False), ("max_num_batched_tokens", False), ("max_num_seqs", False),
                                ("max_waiting", False), ("max_model_len", True), ("num_blocks", True),
                                ("max_num_seqs_per_user", True),
                                ("seed", True), ("tensor_parallel_size", False)):
            v = getattr(self, field)
            if not (is_int(v) or (optional and v is None)):
                raise ValueError(f"{name(field)} must be an integer{' or None' if optional else ''}, got {v!r}")
            if v is not None:
                setattr(self, field, int(v))  # (a numpy integer would reach random.Random)
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, numbers.Real)
                                                 or isinstance(self.kv_cache_memory, bool)):
            raise ValueError(f"{name('kv_cache_memory')} must be a number of GiB, got {self.kv_cache_memory!r}")
        f = self.kv_cache_memory_fraction
        if not isinstance(f, numbers.Real) or isinstance(f, bool) or not 0 < f <= 1:
            raise ValueError(f"{name('kv_cache_memory_fraction')} must be in (0, 1] (a share of the available "
                             f"memory), got {f!r}")
        if not isinstance(self.enable_prefix_caching, (bool, np.bool_)):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path (str or os.PathLike) or None, got {type(self.model).__name__}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"{name('max_model_len')} must be in [2, the model's context length], "
                             f"got {self.max_model_len}")
        for field in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, field) < 1:
                raise ValueError(f"{name(field)} must be ≥ 1, got {getattr(self, field)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"{name('num_blocks')} must be ≥ 1, got {self.num_blocks}")
        if (self.num_blocks is None and self.kv_cache_memory is not None
                and not 0 < self.kv_cache_memory <= MAX_KV_CACHE_GIB):
            raise ValueError(f"{name('kv_cache_memory')} must be in (0, {MAX_KV_CACHE_GIB}] GiB, got {self.kv_cache_memory}")
        if self.max_num_seqs_per_user is not None and not 1 <= self.max_num_seqs_per_user <= self.max_num_seqs:
            raise ValueError(f"{name('max_num_seqs_per_user')} must be in [1, {name('max_num_seqs')}="
                             f"{self.max_num_seqs}] or None, got {self.max_num_seqs_per_user}")
        if self.max_waiting < 0:
            raise ValueError(f"{name('max_waiting')} must be ≥ 0 (0: unbounded), got {self.max_waiting}")
        kv_quant.check_kv_cache_dtype(self.kv_cache_dtype, name("kv_cache_dtype"))
        if self.quantization == "none":
            self.quantization = None
        if self.quantization != "auto" and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"{name('quantization')} must be one of {['auto', *(q or 'none' for q in QUANTIZATIONS)]}, "
                             f"got {self.quantization!r}")
        SpeculativeConfig.parse(self.speculative_config)  # (raises naming speculative_config.<field>)
        KVCompressionConfig.parse(self.kv_compression, name("kv_compression"))  # (raises naming kv_compression.<field>)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"{name('tensor_parallel_size')} must be ≥ 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(f"{name('distributed_executor_backend')} must be 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        if self.kv_connector not in (None, "local", "ray"):
            raise ValueError(f"{name('kv_connector')} must be 'local', 'ray' or None, got {self.kv_connector!r}")
        if self.kv_connector is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"{name('kv_connector')}: KV transfer runs at {name('tensor_parallel_size')} 1 for now "
                             f"(the ranks' shards would each go through the connector)")
        t = self.distributed_timeout_s
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not 0 < t <= 86400:
            raise ValueError(f"{name('distributed_timeout_s')} must be in (0, 86400] seconds, got {t!r}")
        check_swap_options(self.swap_space, self.preemption_mode, name)
        self.kv_offload_dir = check_offload_options(self.kv_offload_dir, self.kv_offload_gib, name)
        if self.kv_offload_dir is not None and not self.enable_prefix_caching:
            raise ValueError(f"{name('kv_offload_dir')}: the disk tier extends the prefix cache, which is off "
                             f"({'--no-prefix-caching' if option_names else 'enable_prefix_caching=False'})")

    def resolved_quantization(self, path: Union[str, os.PathLike], option_names: bool = False) -> Optional[str]:
        """The weight quantization to load the model at ``path`` (as resolved by
        :func:`kvserve.worker.loader.resolve_model_path`) with: :func:`resolve_quantization` of
        :attr:`quantization` (run :meth:`check` first)."""
        return resolve_quantization(self.quantization, path, option_names)


def resolve_quantization(quantization: Optional[str], path: Union[str, os.PathLike],
                         option_names: bool = False) -> Optional[str]:
    """The weight quantization a model file or folder loads with: ``"auto"`` is ``"gguf"`` for a
    ``.gguf`` file (its quantized tensors stay quantized) and None for a Hugging Face folder (its
    float weights as they are); ``"none"`` is None; any other value is kept.

    Args:
        quantization: ``EngineArgs.quantization`` (checked).
        path: the model's ``.gguf`` file or folder.
        option_names: name the field ``--quantization`` in errors.

    Raises:
        ValueError: ``"gguf"`` / ``"gguf_int8"`` for a model that is not a GGUF file (they apply
            only to a GGUF file's quantized tensors), naming the field, the model's format and
            the values allowed for it.
    """
    from pathlib import Path

    path = Path(path)
    is_gguf = path.suffix == ".gguf" and not path.is_dir()
    if quantization == "auto":
        return "gguf" if is_gguf else None
    if quantization == "none":
        return None
    if quantization in GGUF_QUANTIZATIONS and not is_gguf:
        what = "a Hugging Face folder (safetensors weights)" if path.is_dir() else "not a .gguf file"
        allowed = ", ".join(["auto", "none"] + [q for q in QUANTIZATIONS if q is not None and q not in GGUF_QUANTIZATIONS])
        given = f"--quantization {quantization}" if option_names else f"quantization={quantization!r}"
        raise ValueError(f"{given} keeps a GGUF file's quantized tensors quantized, but the model "
                         f"{str(path)!r} is {what}; for it use one of: {allowed} (default: auto, the weights as "
                         f"they are)")
    return quantization


#: the largest KV budget accepted (GiB): beyond it the block count overflows, and no machine has it
MAX_KV_CACHE_GIB = 1 << 20
