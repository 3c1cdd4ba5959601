"""Weight loading: GGUF files (via the ``gguf`` package) and Hugging Face folders
(``config.json`` + ``*.safetensors``).

Both paths yield a :class:`ModelConfig` and a state dict in Hugging Face parameter
names (``model.layers.0.self_attn.q_proj.weight`` ...), dequantized to float32. A progress
bar (tqdm, on stderr) counts the tensors read when stderr is a terminal or kvserve logs at
INFO (``--verbose``); ``TQDM_DISABLE=1`` turns it off everywhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import functools
import json
import logging
import math
import mmap
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import torch

from kvserve.config import GGUF_ARCHITECTURES, ModelConfig, UnsupportedModelError
from kvserve.worker.default_model import ModelNotFoundError, default_model_path

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model file exists but cannot be read (corrupt, truncated, wrong format)."""


def resolve_model_path(model: str | Path | None) -> Path:
    """The model file or folder to load: ``model``, or the default SmolLM2 GGUF when None.

    ``model`` is a ``.gguf`` file, a Hugging Face folder (``config.json`` + ``*.safetensors``),
    a Hugging Face cache entry (a ``models--org--name`` folder: its snapshot), or a repository
    id ``org/name`` that is not a path here, looked up in the local Hugging Face cache
    (:func:`hf_cache_snapshot`; nothing is downloaded). A snapshot that holds one ``.gguf``
    file and no ``config.json`` resolves to that file.

    Raises:
        ModelNotFoundError: if the path does not exist and no cache entry matches (or the
            default model is not installed).
    """
    if model is None:
        return default_model_path()
    if str(model).strip() == "":
        raise ModelNotFoundError("model path is empty: give a .gguf file or a Hugging Face folder, or leave it "
                                 "out for the default model")
    path = Path(model).expanduser()
    if path.is_dir() and path.name.startswith("models--") and (path / "snapshots").is_dir():
        return _snapshot_model(_latest_snapshot(path), str(model))
    if path.exists():
        return path
    if is_repo_id(str(model)):
        snapshot = hf_cache_snapshot(str(model))
        if snapshot is not None:
            return _snapshot_model(snapshot, str(model))
        raise ModelNotFoundError(f"model {str(model)!r} is not a path here and not in the Hugging Face cache "
                                 f"({hf_hub_cache()}/models--{str(model).replace('/', '--')}); kvserve does not "
                                 "download models: give a .gguf file or a model folder, or download it first "
                                 "(e.g. huggingface-cli download)")
    raise ModelNotFoundError(f"model path {str(path)!r} does not exist")


def is_repo_id(model: str) -> bool:
    """Whether ``model`` has the shape of a Hugging Face repository id, ``org/name``."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]", model) is not None and ".." not in model \
        and not model.endswith(".gguf")


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's own rule)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hf_cache_snapshot(repo_id: str, revision: str = "main") -> Optional[Path]:
    """The snapshot folder of ``repo_id`` in the local hub cache
    (``models--org--name/snapshots/<commit>``, the commit ``refs/<revision>`` names, else the
    newest snapshot), or None when the cache has no entry for it."""
    entry = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    if not (entry / "snapshots").is_dir():
        return None
    try:
        return _latest_snapshot(entry, revision)
    except ModelNotFoundError:
        return None


def _latest_snapshot(entry: Path, revision: str = "main") -> Path:
    ref = entry / "refs" / revision
    if ref.is_file():
        snap = entry / "snapshots" / ref.read_text().strip()
        if snap.is_dir():
            return snap
    snaps = sorted((p for p in (entry / "snapshots").iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not snaps:
        raise ModelNotFoundError(f"the Hugging Face cache entry {str(entry)!r} has no snapshot")
    return snaps[-1]


def _snapshot_model(snapshot: Path, model: str) -> Path:
    """A cache snapshot as a model: the folder, or its only ``.gguf`` file when it has no ``config.json``."""
    if (snapshot / "config.json").exists():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelNotFoundError(f"{model!r}: the cache snapshot {str(snapshot)!r} holds {len(ggufs)} .gguf files; "
                                 f"give one of them as the model: {', '.join(p.name for p in ggufs)}")
    raise ModelNotFoundError(f"{model!r}: the cache snapshot {str(snapshot)!r} has neither config.json nor a .gguf "
                             "file (only part of the model was downloaded?)")


def load_model_config(path: Path) -> ModelConfig:
    """Read only a model's config (GGUF metadata or ``config.json``), no weights.

    Raises:
        ModelLoadError: corrupt or unreadable file.
        UnsupportedModelError: an architecture or setting kvserve does not implement.
    """
    if path.is_dir():
        return _hf_config(path)
    if path.suffix == ".gguf":
        return gguf_model_config(_gguf_reader(path), path)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a folder with config.json")


def is_tty(stream) -> bool:
    """Whether ``stream`` is a terminal (False for a replaced or closed stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def show_progress(progress: Optional[bool] = None) -> bool:
    """Whether to draw a progress bar: ``progress`` when given, else when stderr is a terminal
    or the ``kvserve`` logger is enabled for INFO (``--verbose``); never in a test's captured
    stderr unless asked."""
    if progress is not None:
        return progress
    return is_tty(sys.stderr) or logging.getLogger("kvserve").isEnabledFor(logging.INFO)


def _progress_bar(items, total: int, desc: str, progress: Optional[bool]):
    """``items`` wrapped in a tqdm bar of ``total`` tensors (a plain iterator when not shown)."""
    if not show_progress(progress):
        return items
    import threading

    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):  # a thread lock: tqdm's default also makes a multiprocessing
        tqdm.set_lock(threading.RLock())  # semaphore, reported leaked when the engine core is stopped
    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.1 if is_tty(sys.stderr) else 2.0)


def load_weights(path: Path, progress: Optional[bool] = None,
                 keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a model's config and float32 weights.

    Args:
        path: a ``.gguf`` file or a folder with ``config.json`` and ``*.safetensors``.
        progress: draw a progress bar of the tensors read (None: :func:`show_progress`'s
            default, on a terminal or with ``--verbose``).
        keep_quantized: leave a GGUF file's 2-D tensors of the types in
            :data:`kvserve.worker.layers.quant.KEPT_TYPES` quantized, as
            :class:`~kvserve.worker.layers.quant.GGUFWeight` (their raw blocks; q/k rows
            reordered as for float32), for ``quantization="gguf"``; no effect on other files.

    Returns:
        (config, state dict in Hugging Face names, every tensor float32 on CPU, or a
        ``GGUFWeight`` where kept quantized).

    Raises:
        ModelLoadError: corrupt or unreadable file, missing tensors.
        UnsupportedModelError: architecture outside the Llama family.
    """
    if path.is_dir():
        return _load_hf_folder(path, progress)
    if path.suffix == ".gguf":
        return _load_gguf(path, progress, keep_quantized)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a folder with config.json")


# ----------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: Gemma 3's sandwich norms (gguf-py's tensor map for MODEL_ARCH.GEMMA3): ``ffn_norm`` is the
#: norm *before* the MLP there, where Llama's ``ffn_norm`` is ``post_attention_layernorm``.
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _gguf_reader(path: Path) -> "GGUFContents":
    """The parsed GGUF file (a memory map); parsed once per file version, since the config
    check, the tokenizer's class choice and the weight loading of one start all read it."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from e
    return _parsed_gguf(str(path.resolve()), st.st_mtime_ns, st.st_size)


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata (``{"general.architecture": "llama", ...}``: scalars, strings and
    lists as Python values), from the same cached parse as the weights.

    Raises:
        ModelLoadError: the file cannot be read or is not a valid GGUF file.
    """
    return _gguf_reader(Path(path)).metadata


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, as ``gguf.GGUFReader`` describes it.

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``).
        shape: dimensions in ggml order (fastest-moving first).
        tensor_type: the ``gguf.GGMLQuantizationType``.
        data: a read-only view of the file: typed and shaped ``reversed(shape)`` for plain
            float/int types, else ``uint8`` with the bytes of a row last (what
            ``gguf.quants.dequantize`` takes).
    """

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray


class GGUFContents(NamedTuple):
    """A parsed GGUF file: ``metadata`` (key -> Python value), ``tensors`` in file order, and
    the read-only ``mapping`` of the file their data views (None when gguf's reader parsed it)."""

    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    mapping: Optional[mmap.mmap] = None


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, mtime_ns: int, size: int) -> GGUFContents:
    path = Path(path)
    try:
        return _parse_gguf(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from e
    except Exception:  # anything unusual (a big-endian or damaged file): the gguf package decides
        pass
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from e
    except Exception as e:  # numpy's ValueError/IndexError (reshape, out of bounds...) on bad files
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {_bad_gguf_reason(path)}") from e
    return GGUFContents({k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")},
                        [GGUFTensor(t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data)
                         for t in reader.tensors])


#: GGUF metadata value types with a fixed width: type id -> struct code (little-endian)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _parse_gguf(path: Path) -> GGUFContents:
    """Parse a little-endian GGUF v2/v3 file with ``struct`` over a memory map: what
    ``gguf.GGUFReader`` gives, in ~0.1 s instead of ~4.5 s for SmolLM2 (whose 49152 tokens and
    48900 merges it turns into a numpy view each). Raises on anything it does not expect (the
    caller then lets ``GGUFReader`` parse the file, or explain why it cannot)."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    blob = np.frombuffer(mapping, dtype=np.uint8)
    buf = memoryview(blob)
    unpack = struct.unpack_from
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, tensor_count, kv_count = unpack("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = unpack("<Q", buf, pos)
        end = pos + 8 + n
        if end > len(buf):
            raise ValueError("truncated")
        return str(buf[pos + 8:end], "utf-8"), end

    def value(pos: int, kind: int) -> tuple[Any, int]:
        if kind in _GGUF_SCALARS:
            code = "<" + _GGUF_SCALARS[kind]
            return unpack(code, buf, pos)[0], pos + struct.calcsize(code)
        if kind == _GGUF_STRING:
            return string(pos)
        if kind != _GGUF_ARRAY:
            raise ValueError(f"value type {kind}")
        item, count = unpack("<IQ", buf, pos)
        pos += 12
        if item in _GGUF_SCALARS:
            code = _GGUF_SCALARS[item]
            end = pos + count * struct.calcsize(code)
            return list(unpack(f"<{count}{code}", buf, pos)), end
        out = []
        for _ in range(count):
            v, pos = value(pos, item)
            out.append(v)
        return out, pos

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = string(pos)
        (kind,) = unpack("<I", buf, pos)
        metadata[key], pos = value(pos + 4, kind)
    table = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (ndim,) = unpack("<I", buf, pos)
        dims = unpack(f"<{ndim}Q", buf, pos + 4)
        pos += 4 + 8 * ndim
        kind, offset = unpack("<IQ", buf, pos)
        pos += 12
        table.append((name, dims, GGMLQuantizationType(kind), offset))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError("bad general.alignment")
    start = -(-pos // alignment) * alignment
    plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    tensors, names = [], set()
    for name, dims, kind, offset in table:
        if name in names:
            raise ValueError(f"duplicated tensor {name}")
        names.add(name)
        n = math.prod(dims)
        shape = tuple(reversed(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        nbytes = n * type_size // block
        begin = start + offset
        if begin + nbytes > len(blob):
            raise ValueError("truncated")
        if kind in plain:
            data = blob[begin:begin + nbytes].view(plain[kind]).reshape(shape)
        else:
            data = blob[begin:begin + nbytes].reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, tuple(int(d) for d in dims), kind, data))
    return GGUFContents(metadata, tensors, mapping)


def _bad_gguf_reason(path: Path) -> str:
    """Why the gguf package could not parse ``path``, in words (its own errors are numpy's)."""
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        return f"{e.strerror or e}"
    if size == 0:
        return "the file is empty (0 bytes), not a valid GGUF file"
    if len(head) >= 4 and head[:4] != b"GGUF":
        return "the file is not a GGUF file (it does not start with the 'GGUF' magic bytes)"
    if len(head) == 8:
        version = int.from_bytes(head[4:], "little")
        if version & 0xFFFF == 0:  # a big-endian file
            version = int.from_bytes(head[4:], "big")
        if version not in READER_SUPPORTED_VERSIONS:
            supported = " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
            return f"the file is GGUF version {version}; only versions {supported} can be read"
    return (f"the file is truncated or is not a valid GGUF file ({size} bytes; its header or tensor data "
            "is incomplete or corrupt); download or convert it again")


def _field(reader: GGUFContents, key: str, default=None):
    return reader.metadata.get(key, default)


def gguf_model_config(reader: GGUFContents, path: Path) -> ModelConfig:
    """ModelConfig from a GGUF header (``general.architecture`` and ``{arch}.*`` keys)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; kvserve supports {sorted(GGUF_ARCHITECTURES)}"
        )
    a = arch
    hidden = int(_field(reader, f"{a}.embedding_length"))
    num_heads = int(_field(reader, f"{a}.attention.head_count"))
    vocab = _field(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.metadata["tokenizer.ggml.tokens"])
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    rope_scaling = None
    if _field(reader, f"{a}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{a}.rope.scaling.factor"))}
    head_dim = _field(reader, f"{a}.attention.key_length") or hidden // num_heads
    extra = _gguf_gemma3_fields(reader, hidden, num_heads, int(head_dim)) if arch == "gemma3" else {}
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=int(_field(reader, f"{a}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        name=path.name.removesuffix(".gguf"),
        **extra,
    )


def _gguf_gemma3_fields(reader, hidden: int, num_heads: int, head_dim: int) -> dict:
    """The Gemma 3 fields a GGUF header holds or implies.

    llama.cpp's converter writes ``gemma3.attention.sliding_window`` and the global
    ``rope.freq_base`` only; what it leaves out is fixed by llama.cpp's gemma3 model and by
    ``transformers.Gemma3TextConfig``'s defaults alike: every 6th layer global (the others
    sliding), local RoPE base 10000, ``query_pre_attn_scalar = head_dim`` (256; llama.cpp uses
    ``hidden / heads`` for the 62-layer 27B, done here too), gelu-tanh, ``sqrt(hidden)``
    embedding scale. A ``sliding_window_pattern`` key (an int, or one bool per layer, True =
    sliding) is honoured when present; linear RoPE scaling applies to the global layers.

    Raises:
        UnsupportedModelError: the header sets logit softcapping.
    """
    a = "gemma3"
    n_layers = int(_field(reader, f"{a}.block_count"))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if _field(reader, f"{a}.{key}") is not None:
            raise UnsupportedModelError(f"GGUF {a}.{key} is set: softcapping is not supported for Gemma 3")
    pattern = _field(reader, f"{a}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelLoadError(f"GGUF {a}.attention.sliding_window_pattern has {len(pattern)} entries, "
                                 f"expected {n_layers}")
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n_layers)]
    return dict(
        sliding_window=int(_field(reader, f"{a}.attention.sliding_window", 4096)),
        layer_types=layer_types,
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(hidden // num_heads if n_layers == 62 else head_dim),
        hidden_act="gelu_pytorch_tanh",
        norm_style="gemma",
        embedding_multiplier=float(hidden) ** 0.5,
    )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of ``attn_q``/``attn_k``.

    llama.cpp stores the rotary pairs interleaved (GPT-J style) while Hugging Face Llama
    rotates the two halves of each head (NeoX style); the converter reorders rows per head
    as ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``. This applies the inverse.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _nibbles(qs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:, :16]`` = the low nibbles of ``qs`` (``[blocks, 16]`` uint8), ``out[:, 16:]`` the high
    ones (ggml's order within a block), converted to ``out``'s dtype."""
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out


def _dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.view(torch.float16)[:, :1].float()  # (blocks of 34 bytes: 17 halves, the first the scale)
    return b[:, 2:].view(torch.int8).float().mul_(d)


def _dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = b.view(torch.float16)[:, :1].float()
    q = _nibbles(b[:, 2:], torch.empty(b.shape[0], 32, dtype=torch.int8)).sub_(8)
    return d * q.float()


def _dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    dm = b.view(torch.float16)[:, :2].float()
    return _nibbles(b[:, 4:], torch.empty(b.shape[0], 32)).mul_(dm[:, :1]).add_(dm[:, 1:])


#: Block formats dequantized with torch (2.4x gguf's numpy on one thread, SmolLM2), with gguf.quants' exact
#: arithmetic (float32 ``d * q (+ m)``, the same roundings): GGMLQuantizationType name -> function
#: of the ``[blocks, block bytes]`` uint8 tensor -> ``[blocks, 32]`` float32.
_TORCH_DEQUANTIZE = {"Q8_0": _dequantize_q8_0, "Q4_0": _dequantize_q4_0, "Q4_1": _dequantize_q4_1}


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """float32 values of a GGUF tensor's data (``gguf.quants.dequantize``'s result, flattened
    for the formats of :data:`_TORCH_DEQUANTIZE`)."""
    fast = _TORCH_DEQUANTIZE.get(qtype.name)
    if fast is None:
        from gguf.quants import dequantize

        return dequantize(data, qtype)
    from gguf import GGML_QUANT_SIZES

    _, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.array(data, copy=True).reshape(-1, block_bytes))  # (the map is read-only)
    return fast(blocks).numpy().reshape(-1)


def _load_gguf(path: Path, progress: Optional[bool] = False,
               keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from kvserve.worker.layers.quant import KEPT_TYPES, gguf_weight_from_numpy

    reader = _gguf_reader(path)
    cfg = gguf_model_config(reader, path)
    gemma = cfg.architecture == "Gemma3ForCausalLM"
    layer_names = _GGUF_GEMMA3_LAYER_NAMES if gemma else _GGUF_LAYER_NAMES
    state: dict[str, torch.Tensor] = {}
    for t in _progress_bar(reader.tensors, len(reader.tensors), f"Loading {path.name}", progress):
        quantized = keep_quantized and t.tensor_type.name in KEPT_TYPES and len(t.shape) == 2
        try:
            if quantized:
                arr = gguf_weight_from_numpy(t.tensor_type.name, t.data, (int(t.shape[1]), int(t.shape[0])))
            else:
                arr = _dequantize(t.data, t.tensor_type)
                arr = np.asarray(arr, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize tensor {t.name!r} of {str(path)!r}: {e}") from e
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in layer_names:
                logger.warning("ignoring unknown GGUF tensor %s", name)
                continue
            hf = f"model.layers.{idx}.{layer_names[rest]}"
            heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(rest.split(".")[0])
            if cfg.architecture == "LlamaForCausalLM" and heads is not None:
                if quantized:  # (whole rows move: the same permutation of the row indices)
                    arr = arr.rows(torch.from_numpy(_unpermute_rope(np.arange(arr.shape[0]), heads)))
                else:
                    arr = _unpermute_rope(arr, heads)
        else:
            logger.warning("ignoring unknown GGUF tensor %s", name)
            continue
        if quantized:
            state[hf] = arr
            continue
        if gemma and "norm.weight" in name:
            # llama.cpp stores Gemma's RMSNorm weights as 1 + w; transformers' GGUF loader
            # (Gemma2TensorProcessor, also used for gemma3) subtracts 1 in float32, and the
            # model adds it back: the same two roundings here.
            arr = arr - np.float32(1.0)
        if not (arr.flags.writeable and arr.flags.c_contiguous):  # (e.g. an F32 tensor viewing the file)
            arr = np.array(arr, dtype=np.float32, copy=True)
        state[hf] = torch.from_numpy(arr)
    if reader.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        # the file's pages stay in the page cache, but no longer count in this process's resident
        # set (~90 MB for SmolLM2); the cached parse still reads them if the file is loaded again
        reader.mapping.madvise(mmap.MADV_DONTNEED)
    return cfg, state


# ------------------------------------------------------------------ Hugging Face folder


def _hf_config(path: Path) -> ModelConfig:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json")
    try:
        cfg_dict = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{str(cfg_path)!r} is not valid JSON: {e}") from e
    return ModelConfig.from_hf_dict(cfg_dict, name=path.name)


def _load_hf_folder(path: Path, progress: Optional[bool] = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    cfg = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors files")
    errors = (SafetensorError, OSError, RuntimeError)
    keys = {}
    for f in files:  # (the headers first, for the bar's total)
        try:
            with safe_open(str(f), "pt") as h:
                keys[f] = list(h.keys())
        except errors as e:
            raise ModelLoadError(f"cannot read {str(f)!r}: {e}") from e

    def tensors():
        for f in files:
            try:
                with safe_open(str(f), "pt") as h:
                    for k in keys[f]:
                        yield f, k, h.get_tensor(k)
            except errors as e:
                raise ModelLoadError(f"cannot read {str(f)!r}: {e}") from e

    state: dict[str, torch.Tensor] = {}
    total = sum(len(k) for k in keys.values())
    for _, k, v in _progress_bar(tensors(), total, f"Loading {path.name}", progress):
        state[k] = v.float()
    return cfg, state


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run torch's CPU ops on at most ``n`` threads inside the block (the caller's thread; restored after).

    Loading runs thousands of small ops (dequantize, fuse, convert, pack) that gain little from
    more threads, and on a busy machine each parallel one waits for all its threads to be
    scheduled at once: next to other jobs on 2 cores, SmolLM2's engine took 37 s to start with
    2 OpenMP threads and 7 s with ``OMP_NUM_THREADS=1`` (the tokenizer thread uses the other
    core meanwhile)."""
    old = torch.get_num_threads()
    if old <= n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def release_freed_memory() -> None:
    """Hand the memory of freed tensors back to the OS: a garbage collection, then glibc's
    ``malloc_trim(0)`` where it exists. After loading, glibc keeps the freed float32 state dict
    (~430 MB for SmolLM2) in its heap, resident, until it is trimmed."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def iter_layer_names(cfg: ModelConfig) -> Iterator[str]:
    """Every parameter name the model needs (for completeness checks): the Llama family's,
    plus Gemma's pre/post feed-forward norms."""
    yield "model.embed_tokens.weight"
    yield "model.norm.weight"
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.weight"):
            yield p + n
        for n in ("q", "k", "v"):
            yield p + f"self_attn.{n}_proj.weight"
            if cfg.attention_bias:
                yield p + f"self_attn.{n}_proj.bias"
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight"
            yield p + "self_attn.k_norm.weight"
        if cfg.norm_style == "gemma":
            yield p + "pre_feedforward_layernorm.weight"
            yield p + "post_feedforward_layernorm.weight"
