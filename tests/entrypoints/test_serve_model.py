"""``kvserve serve MODEL`` as ``vllm serve`` takes it: a GGUF file, a Hugging Face folder, or a
repository id found in the local Hugging Face cache; ``kvserve --version``;
``--chat-template FILE_OR_TEMPLATE``; sampling defaults from the model's generation config.

The ``kvserve serve`` runs are real server processes on SmolLM2 (its GGUF, and a Hugging Face
folder and cache entry written from that GGUF), one at a time.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvserve.engine.generation_config import describe, generation_defaults
from kvserve.engine.tokenizer import load_chat_template
from kvserve.entrypoints.cli import build_parser, main
from kvserve.worker.default_model import ModelNotFoundError
from kvserve.worker.loader import hf_cache_snapshot, resolve_model_path

SRC = str(Path(__file__).parents[2] / "src")
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}<|im_start|>assistant:"


def _kvserve(args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


# ------------------------------------------------------------------ quick ones
def test_version_prints_the_package_version():
    p = _kvserve(["--version"])
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out == importlib.metadata.version("kvserve") + "\n" and err == ""
    import kvserve

    assert kvserve.__version__ == importlib.metadata.version("kvserve")


def test_model_positional_or_option_but_not_two_different_ones(capsys):
    parse = build_parser().parse_args
    assert parse(["serve", "a.gguf"]).model_tag == "a.gguf" and parse(["serve", "a.gguf"]).model is None
    assert parse(["serve", "--model", "a.gguf"]).model_tag is None
    assert main(["serve", "a.gguf", "--model", "b.gguf", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "the model is given twice, as MODEL 'a.gguf' and as --model 'b.gguf'" in err
    assert main(["serve", "missing.gguf", "--model", "missing.gguf", "--port", "0"]) == 2  # the same twice is one model
    assert "'missing.gguf' does not exist" in capsys.readouterr().err


def _cache_entry(hub: Path, repo: str, files: dict[str, bytes | Path], commit: str = "0123abcd") -> Path:
    """A hub cache entry laid out as huggingface_hub writes it: blobs, a snapshot of links, refs/main."""
    entry = hub / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / commit
    (entry / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for i, (name, data) in enumerate(files.items()):
        blob = entry / "blobs" / f"{commit}{i:04d}"
        if isinstance(data, Path):
            os.symlink(data.resolve(), blob)
        else:
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(commit)
    return snap


def test_repository_ids_resolve_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = tmp_path / "hf" / "hub"
    folder = _cache_entry(hub, "org/folder-model", {"config.json": b"{}", "model.safetensors": b""})
    _cache_entry(hub, "org/folder-model", {"config.json": b"{}"}, commit="older")  # refs/main names the first
    (hub / "models--org--folder-model" / "refs" / "main").write_text("0123abcd")
    gguf = _cache_entry(hub, "org/gguf-model", {"model.Q4_0.gguf": b"GGUF"})
    two = _cache_entry(hub, "org/two-ggufs", {"a.gguf": b"GGUF", "b.gguf": b"GGUF"})
    assert resolve_model_path("org/folder-model") == folder
    assert resolve_model_path("org/gguf-model") == gguf / "model.Q4_0.gguf"
    assert resolve_model_path(hub / "models--org--gguf-model") == gguf / "model.Q4_0.gguf"  # the entry's folder
    assert resolve_model_path(str(folder)) == folder  # a snapshot is a plain folder
    with pytest.raises(ModelNotFoundError, match=r"holds 2 \.gguf files; give one of them as the model: a.gguf, b.gguf"):
        resolve_model_path("org/two-ggufs")
    assert resolve_model_path(two / "a.gguf") == two / "a.gguf"
    with pytest.raises(ModelNotFoundError, match="not a path here and not in the Hugging Face cache .*models--org--absent"
                                                 ".*kvserve does not download models"):
        resolve_model_path("org/absent")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path("./org/absent")  # a path, not an id
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # huggingface_hub's order: this one first
    assert hf_cache_snapshot("org/folder-model") is None


def test_chat_template_from_a_file_or_a_string(tmp_path):
    f = tmp_path / "template.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="--chat-template: 'no-such-file.jinja' is neither a file nor a Jinja template"):
        load_chat_template("no-such-file.jinja")
    f.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match=r"--chat-template: '.*template.jinja' is not a valid Jinja template: .* \(line 1\)"):
        load_chat_template(str(f))
    # loop controls, as transformers' templates use them
    assert load_chat_template("{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}")


def test_generation_defaults_from_a_folder_and_a_gguf(tmp_path, smollm2_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.0, "max_new_tokens": 100,
        "do_sample": True, "bos_token_id": 1, "min_p": "high"}))
    got = generation_defaults(tmp_path)
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}  # neutral / bad values left out
    assert describe(got) == "temperature=0.6, top_p=0.95, top_k=20, max_tokens=100"
    assert generation_defaults(tmp_path, "vllm") == {} and describe({}) is None
    assert generation_defaults(smollm2_path) == {}  # this GGUF has no general.sampling.* metadata
    assert generation_defaults(smollm2_path, str(tmp_path)) == got  # another folder's
    with pytest.raises(ValueError, match="has no generation_config.json"):
        generation_defaults(smollm2_path, str(tmp_path / "nothing"))


# ------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def hf_folder(smollm2_path, tmp_path_factory):
    """SmolLM2 as a Hugging Face folder written from the shipped GGUF: config and tokenizer (with
    its chat template) by transformers, the weights (bfloat16 safetensors, tied embeddings without
    an lm_head) from the GGUF's tensors; and a generation_config.json."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from kvserve.worker.loader import load_weights

    d = tmp_path_factory.mktemp("smollm2-hf")
    kw = dict(gguf_file=smollm2_path.name)
    AutoTokenizer.from_pretrained(str(smollm2_path.parent), **kw).save_pretrained(str(d))
    config = AutoConfig.from_pretrained(str(smollm2_path.parent), **kw)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(d))
    _, state = load_weights(smollm2_path)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "top_k": 1, "do_sample": True,
                                                          "eos_token_id": 2}))
    return d


def _serving(args: list[str], env: dict | None = None):
    """``kvserve serve ARGS`` until /health answers: (process, base URL, its start-up lines)."""
    from server_helpers import free_port

    port = free_port()
    p = _kvserve(["serve", *args, "--port", str(port), "--kv-cache-memory", "0.05", "--max-model-len", "512",
                  "--no-access-log"], env)
    lines, deadline = [], time.monotonic() + 240
    try:
        while True:
            line = p.stderr.readline()
            assert line and time.monotonic() < deadline, f"the server did not start:\n{''.join(lines)}"
            lines.append(line)
            if "web page (chat, dashboard) at" in line:
                break
        base = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    return p, base, "".join(lines)
            except httpx.TransportError:
                pass
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    except BaseException:
        p.kill()
        p.wait(10)
        raise


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)


def _chat(base: str, **kw) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "Name a color."}]} | kw)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_serve_a_gguf_file_with_a_chat_template_file(smollm2_path, tmp_path):
    f = tmp_path / "chat.jinja"
    f.write_text(TEMPLATE)
    p, base, log = _serving([str(smollm2_path), "--chat-template", str(f), "--reasoning-parser", "deepseek_r1"])
    try:
        assert f"({smollm2_path}," in log and "sampling defaults from the model's generation config: none" in log
        assert "reasoning parser deepseek_r1, chat template from --chat-template" in log
        model = httpx.get(base + "/v1/models").json()["data"][0]
        assert (model["id"], model["root"]) == ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct.Q4_1")  # (no file path: issue #21)
        ids = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        text = httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "<|im_start|>user: Hi\n<|im_start|>assistant:"
        assert _chat(base, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])["usage"]["prompt_tokens"] == len(ids)
        # the thinking budget with the engine core in its own process (the default): 3 thinking
        # tokens, the appended </think>, then the answer, whole and streamed alike
        end = len(httpx.post(base + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"])
        body = _chat(base, max_tokens=3 + end + 4, temperature=0, ignore_eos=True, max_thinking_tokens=3)
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] and body["usage"]["completion_tokens"] == 3 + end + 4
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 3 + end + 4, "temperature": 0,
                "ignore_eos": True, "max_thinking_tokens": 3, "stream": True}) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    finally:
        _stop(p)


@pytest.mark.slow
def test_serve_a_hugging_face_folder_with_its_generation_config_and_a_template_string(hf_folder):
    p, base, log = _serving([str(hf_folder), "--chat-template", TEMPLATE])
    try:
        assert "sampling defaults from the model's generation config: top_k=1, max_tokens=5 (a request's own " \
               "values win)" in log
        model = httpx.get(base + "/v1/models").json()["data"][0]
        assert (model["id"], model["root"]) == (hf_folder.name, hf_folder.name)
        body = _chat(base, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
        assert _chat(base, ignore_eos=True, max_tokens=2)["usage"]["completion_tokens"] == 2
        ids = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        assert httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"] == \
            "<|im_start|>user: Hi\n<|im_start|>assistant:"
    finally:
        _stop(p)


@pytest.mark.slow
def test_serve_a_repository_id_from_the_hugging_face_cache(hf_folder, tmp_path):
    files = {f.name: f for f in hf_folder.iterdir() if f.is_file()}
    snap = _cache_entry(tmp_path / "hf" / "hub", "kvserve-test/SmolLM2-135M-Instruct", files)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": ""}
    p, base, log = _serving(["kvserve-test/SmolLM2-135M-Instruct", "--generation-config", "vllm"], env)
    try:
        assert f"serving 'kvserve-test/SmolLM2-135M-Instruct' ({snap}," in log
        assert "sampling defaults from --generation-config vllm: none" in log
        model = httpx.get(base + "/v1/models").json()["data"][0]
        assert (model["id"], model["root"]) == ("kvserve-test/SmolLM2-135M-Instruct", "kvserve-test/SmolLM2-135M-Instruct")
        body = _chat(base, model="kvserve-test/SmolLM2-135M-Instruct", max_tokens=4, temperature=0, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["message"]["content"]
        # the model's own template (ChatML), not the one of the other tests
        ids = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
        assert "<|im_start|>user\nHi<|im_end|>" in httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"]
    finally:
        _stop(p)
    missing = _kvserve(["serve", "kvserve-test/absent", "--port", "0"], env)
    _, err = missing.communicate(timeout=120)
    assert missing.returncode == 2 and "not in the Hugging Face cache" in err and "Traceback" not in err
