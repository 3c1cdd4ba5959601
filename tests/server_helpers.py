"""Shared helpers of the server tests: run the OpenAI server in a background thread."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx
import uvicorn


#: A plain chat template for the tiny random-weight models (their tokenizers have none).
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def tiny_chat_engine(folder, **kw):
    """An ``LLMEngine`` (float32, block size 4) on the tiny model in ``folder`` with
    :data:`CHAT_TEMPLATE`; ``kw`` are more ``EngineArgs`` (or override those)."""
    from kvserve.engine.llm_engine import EngineArgs, LLMEngine

    args = dict(model=str(folder), dtype="float32", block_size=4)
    args.update(kw)
    engine = LLMEngine(EngineArgs(**args))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


def pid_gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CLIServer:
    """``kvserve serve --model MODEL`` in a subprocess (float32, a 0.05 GiB KV pool, 4,096-token
    context unless ``extra`` says otherwise: later options win), its stderr collected by a thread;
    ready once ``/health`` answers 200 (at most 180 s). ``new_session``: the server leads a
    process group of its own (its engine core in it), for signals sent to the whole group."""

    def __init__(self, folder, *extra: str, new_session: bool = False) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                            os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", str(folder), "--dtype", "float32",
             "--kv-cache-memory", "0.05", "--max-model-len", "4096", "--port", str(self.port), "--no-access-log",
             *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=new_session)
        self.lines: list[str] = []
        self.core_pid = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get(self.base + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and self.proc.poll() is None, f"no start: {self.stderr}"
                time.sleep(0.1)
            assert self.core_pid is not None, self.stderr
        except BaseException:
            self.kill()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if self.core_pid is None and "engine core in process" in line:
                self.core_pid = int(line.split("engine core in process ")[1].split(")")[0])

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class ServerThread:
    """``build_app(engine)`` on uvicorn, on a free loopback port, in a daemon thread.

    ``engine``: an ``LLMEngine`` (stepped in a thread), or ``EngineArgs`` / a ``CoreClient``
    (the engine core in its own process). ``uvicorn_options`` go to ``uvicorn.Config``, the
    other keyword arguments to ``build_app``.

    Attributes:
        base_url: ``http://127.0.0.1:PORT``.
        api: the :class:`kvserve.entrypoints.openai.OpenAIServer` (its ``async_engine``, ``metrics``...).
    """

    def __init__(self, engine, names: Sequence[str] = ("test-model",), api_key: Optional[str] = None,
                 uvicorn_options: Optional[dict] = None, **kwargs) -> None:
        from kvserve.entrypoints.openai import build_app

        app = build_app(engine, list(names), api_key=api_key, **kwargs)
        self.api = app.state.server
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2, **(uvicorn_options or {}))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def engine_call(self, fn, *args):
        """Run ``fn(engine)`` on the engine thread (thread-safe) and return its result; ``fn``
        may be a public engine method's name (called with ``args``), the only form that works
        with the engine core in its own process."""
        return self.api.async_engine.call_sync(fn, *args)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine has no unfinished request."""
        deadline = time.monotonic() + timeout
        while self.engine_call("has_unfinished_requests"):
            if time.monotonic() > deadline:
                raise TimeoutError("engine still busy")
            time.sleep(0.02)


def request_counts(families) -> dict[str, float]:
    """The replicas' request counters in metric families (a registry's ``collect()`` or
    ``prometheus_client.parser.text_string_to_metric_families`` of ``/metrics``):
    ``{"<replica> <finished_reason>" | "<replica> retries": value}``."""
    out = {}
    for family in families:
        for smp in family.samples:
            if smp.name == "kvserve:request_success_total":
                out[f"{smp.labels['replica']} {smp.labels['finished_reason']}"] = smp.value
            elif smp.name == "kvserve:request_retries_total":
                out[f"{smp.labels['replica']} retries"] = smp.value
    return out


def accumulate_chat_stream(chunks, no_text: Sequence[str] = ("<tool_", "tool_call>")):
    """What an OpenAI client makes of a streamed chat reply (one choice): (content or None,
    [(id, name, arguments)], finish reasons), checking each tool-call chunk's shape on the way
    (a call's first chunk: id, type, name and empty arguments; then pieces of the arguments)
    and that no content delta holds any of ``no_text`` (a tool-call format's markers: a tag
    split over tokens never leaks into the content)."""
    content, calls, finishes = [], {}, []
    for ch in chunks:
        assert len(ch.choices) == 1
        c = ch.choices[0]
        if c.finish_reason:
            finishes.append(c.finish_reason)
        if c.delta.content:
            assert not any(t in c.delta.content for t in no_text), c.delta.content
            content.append(c.delta.content)
        for tc in c.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
                assert tc.function.name and tc.function.arguments == ""
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None and tc.function.arguments
                calls[tc.index][2] += tc.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return ("".join(content) or None), [tuple(calls[i]) for i in sorted(calls)], finishes
