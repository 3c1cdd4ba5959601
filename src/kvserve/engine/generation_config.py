"""A model's recommended sampling settings, as the server's defaults (vLLM's
``--generation-config auto``).

A Hugging Face folder's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, ``max_new_tokens``), or a GGUF file's ``general.sampling.*``
metadata (``temp``, ``top_p``, ``top_k``, ``min_p``, ``penalty_repeat``). The server applies
them to a request that does not set the field itself; values equal to the neutral setting
(``temperature`` 1, ``top_p`` 1, ``top_k`` 0, ``min_p`` 0, ``repetition_penalty`` 1) are left out.
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import Optional, Union

logger = logging.getLogger(__name__)

#: generation_config.json key → SamplingParams field
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
#: GGUF metadata key → SamplingParams field
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
_INTEGER = ("top_k", "max_tokens")

Defaults = dict[str, Union[int, float]]


def generation_defaults(model_path: Union[str, Path], source: str = "auto") -> Defaults:
    """The sampling defaults recommended with a model.

    Args:
        model_path: the resolved model (a ``.gguf`` file or a Hugging Face folder).
        source: ``"auto"`` (the model's own: its folder's ``generation_config.json`` or its
            GGUF metadata), ``"vllm"`` or ``"none"`` (no defaults: kvserve's, as vLLM's
            ``--generation-config vllm``), or a folder holding a ``generation_config.json``.

    Returns:
        SamplingParams field → value (``max_new_tokens`` becomes ``max_tokens``); empty when
        the model recommends nothing. A value of the wrong type is skipped with a warning.

    Raises:
        ValueError: ``source`` is a folder without ``generation_config.json``, or that file is
            not a JSON object.
    """
    if source in ("vllm", "none"):
        return {}
    path = Path(model_path)
    if source != "auto":
        folder = Path(source).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config: {str(folder)!r} has no generation_config.json (give 'auto', "
                             "'vllm' or a folder holding one)")
        return _from_json(folder / "generation_config.json")
    if path.is_dir():
        f = path / "generation_config.json"
        return _from_json(f) if f.is_file() else {}
    if path.suffix == ".gguf":
        from kvserve.worker.loader import gguf_metadata

        meta = gguf_metadata(path)
        return _clean({field: meta[key] for key, field in GGUF_KEYS.items() if key in meta}, str(path))
    return {}


def _from_json(f: Path) -> Defaults:
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {str(f)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {str(f)!r} is not a JSON object")
    return _clean({field: data[key] for key, field in HF_KEYS.items() if data.get(key) is not None}, str(f))


def _clean(values: dict, where: str) -> Defaults:
    out: Defaults = {}
    for field, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or (field in _INTEGER and int(v) != v):
            logger.warning("%s: ignoring %s = %r (not a %s)", where, field, v,
                           "whole number" if field in _INTEGER else "number")
            continue
        v = int(v) if field in _INTEGER else float(v)
        if _NEUTRAL.get(field) == v:
            continue
        out[field] = v
    return out


def describe(defaults: Defaults) -> Optional[str]:
    """``"temperature=0.6, top_p=0.95"``, or None when there are none."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items()) or None
