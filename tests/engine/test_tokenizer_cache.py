"""The on-disk cache of GGUF tokenizers (kvserve.engine.tokenizer): the first load rebuilds the
tokenizer from the file's metadata and saves it; later loads read it and give the same
tokenizer; a changed file, a damaged entry, an unwritable folder and ``KVSERVE_CACHE_DIR=off``
fall back to a rebuild, never to an error."""

from __future__ import annotations

import os
import shutil

import pytest

from kvserve.engine import tokenizer as tokenizer_mod
from kvserve.engine.tokenizer import apply_chat_template, cache_dir, load_tokenizer

TEXTS = ["The capital of France is", "  two\n\n\ttabs ünïcödé 👋", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture
def builds(monkeypatch):
    """The GGUF files whose tokenizer was rebuilt from the metadata during the test."""
    seen = []
    real = tokenizer_mod._build_gguf
    monkeypatch.setattr(tokenizer_mod, "_build_gguf", lambda p: seen.append(p) or real(p))
    return seen


def _entries(root):
    d = root / "tokenizers"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert ids == b.encode(text, add_special_tokens=special)
            assert a.decode(ids) == b.decode(ids)
            assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, a.unk_token_id, a.chat_template, a.name_or_path) == (
        b.bos_token_id, b.eos_token_id, b.pad_token_id, b.unk_token_id, b.chat_template, b.name_or_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert apply_chat_template(a, messages) == apply_chat_template(b, messages)


def test_second_load_reads_the_cache_and_equals_the_rebuilt_tokenizer(smollm2_path, tmp_path, monkeypatch, builds):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    first = load_tokenizer(smollm2_path)
    assert builds == [smollm2_path] and len(_entries(tmp_path)) == 1  # (no temporary folder left)
    second = load_tokenizer(smollm2_path)
    assert builds == [smollm2_path]  # read from the cache
    _assert_same(first, second)
    assert type(second).__name__ == "TokenizersBackend"  # the class AutoTokenizer picks for a llama GGUF


def test_a_changed_file_is_rebuilt(smollm2_path, tmp_path, monkeypatch, builds):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "model" / smollm2_path.name
    copy.parent.mkdir()
    shutil.copyfile(smollm2_path, copy)
    load_tokenizer(copy)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place, same size
    changed = load_tokenizer(copy)
    assert builds == [copy, copy] and len(_entries(tmp_path / "cache")) == 2
    assert changed.name_or_path == str(copy.parent)


def test_a_damaged_entry_is_rebuilt_and_replaced(smollm2_path, tmp_path, monkeypatch, builds):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    good = load_tokenizer(smollm2_path)
    (entry,) = _entries(tmp_path)
    (tmp_path / "tokenizers" / entry / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(smollm2_path)
    assert builds == [smollm2_path, smollm2_path]
    _assert_same(good, again)
    load_tokenizer(smollm2_path)
    assert len(builds) == 2 and _entries(tmp_path) == [entry]  # the entry was written again


@pytest.mark.parametrize("setting", ["off", "unwritable"])
def test_cache_off_or_unwritable_still_loads(smollm2_path, tmp_path, monkeypatch, builds, setting):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", "off" if setting == "off" else str(blocker / "cache"))
    assert (cache_dir() is None) == (setting == "off")
    a, b = load_tokenizer(smollm2_path), load_tokenizer(smollm2_path)
    assert builds == [smollm2_path, smollm2_path]
    _assert_same(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "kvserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "kvserve"
