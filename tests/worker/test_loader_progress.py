"""The weight loader's progress bar: drawn on stderr when asked, on a terminal or with kvserve
logging at INFO (--verbose), counting every tensor of a Hugging Face folder or a GGUF file;
absent otherwise (captured test output, a log file without --verbose); the weights are the same
either way."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from kvserve.worker.loader import load_weights, show_progress


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def _bar_total(err: str, name: str):
    """(done, total) of the last state of the bar named ``Loading name`` in ``err``, or None."""
    states = re.findall(rf"Loading {re.escape(name)}: +\d+%\|[^|]*\| *(\d+)/(\d+)", err)
    return tuple(map(int, states[-1])) if states else None


def test_a_folder_load_counts_every_tensor_and_reads_the_same_weights(folder, capsys):
    cfg_quiet, quiet = load_weights(folder, progress=False)
    assert capsys.readouterr().err == ""
    cfg, state = load_weights(folder, progress=True)
    err = capsys.readouterr().err
    n = len(state)
    assert n == len(quiet) > 10 and _bar_total(err, folder.name) == (n, n), err
    assert cfg == cfg_quiet and all(torch.equal(state[k], quiet[k]) for k in quiet)


def test_by_default_the_bar_shows_on_a_terminal_or_with_verbose_logging(folder, capsys, caplog, monkeypatch):
    load_weights(folder)  # (pytest captures stderr: not a terminal; kvserve logs at WARNING)
    assert capsys.readouterr().err == "" and not show_progress()
    caplog.set_level(logging.INFO, logger="kvserve")  # --verbose
    assert show_progress()
    load_weights(folder)
    assert _bar_total(capsys.readouterr().err, folder.name) is not None
    caplog.set_level(logging.WARNING, logger="kvserve")
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert show_progress() and not show_progress(False)


def test_an_engine_built_in_a_test_prints_no_bar(folder, capsys):
    from kvserve import LLM

    LLM(model=str(folder), dtype="float32", num_blocks=16, block_size=4, max_model_len=64)
    assert "Loading" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_gguf_load_counts_every_tensor(smollm2_path, capsys):
    _, state = load_weights(smollm2_path, progress=True)
    done, total = _bar_total(capsys.readouterr().err, smollm2_path.name)
    assert done == total >= len(state) > 100  # (tensors the model does not use are read and skipped)
