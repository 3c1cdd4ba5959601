"""The server's web page, offline docs and dashboard data, its chat template and generation
defaults, and the reasoning options' checks, on a tiny random model (the real model's reasoning
replies are in test_server_reasoning.py, the page in a browser in test_web_browser.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerThread

from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.entrypoints.openai.web import STATIC_DIR, docs_assets_dir

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}>>"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    folder = tiny_model_dir("llama")[0]
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="float32", num_blocks=256, block_size=4, max_model_len=256))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, names=["tiny"]) as s:
        yield s


def test_the_page_and_every_asset_it_names_are_served_from_here(server):
    r = httpx.get(server.base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>kvserve</title>" in r.text
    assets = re.findall(r'(?:src|href)="([^"#]+)"', r.text)
    assert sorted(a for a in assets if a.startswith("/static/")) == ["/static/app.css", "/static/app.js",
                                                                      "/static/charts.js"]
    for a in assets:
        assert a.startswith("/") or a.startswith("data:"), a  # nothing from another host
        if a.startswith("/static/"):
            got = httpx.get(server.base_url + a)
            assert got.status_code == 200 and got.content == (STATIC_DIR / a.removeprefix("/static/")).read_bytes()
    for f in STATIC_DIR.iterdir():  # no address of another host anywhere in the page's files
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", f.read_text()), f.name


def test_api_docs_load_nothing_from_a_cdn(server):
    assets = ["/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css", "/docs-assets/favicon.png"]
    html = httpx.get(server.base_url + "/docs").text
    urls = re.findall(r'(?:src|href)=["\']([^"\']+)["\']|url: ?["\']([^"\']+)["\']', html)
    urls = [u for pair in urls for u in pair if u]
    assert set(assets) <= set(urls) and "/openapi.json" in html
    assert not [u for u in urls if "//" in u], urls
    assert "cdn" not in html.lower() and '"validatorUrl": null' in html
    assert httpx.get(server.base_url + "/redoc").status_code == 404  # (ReDoc fetches its logo from a CDN)
    for a in assets:
        got = httpx.get(server.base_url + a)
        assert got.status_code == 200 and len(got.content) == (docs_assets_dir() / Path(a).name).stat().st_size
    spec = httpx.get(server.base_url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/dashboard/stats" in spec["paths"]


def test_dashboard_stats_show_the_requests_that_ran(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    before = httpx.get(server.base_url + "/dashboard/stats").json()
    runs = []
    for prompt, n in (([5, 6, 7], 4), ([9, 10, 11, 12, 13], 6)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True})
        runs.append((r.usage.prompt_tokens, r.usage.completion_tokens))
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage][0]
    runs.append((usage.prompt_tokens, usage.completion_tokens))
    server.wait_idle()
    stats = httpx.get(server.base_url + "/dashboard/stats").json()
    new = stats["requests"][len(before["requests"]):]
    assert [(q["prompt_tokens"], q["output_tokens"]) for q in new] == runs == [(3, 4), (5, 6), (runs[2][0], 5)]
    for q in new:
        assert q["finish_reason"] == "length"
        assert 0 <= q["queue_time"] <= q["ttft"] <= q["e2e"] and q["tpot"] > 0
        assert q["tpot"] <= q["e2e"]
    assert len(stats["itl"]) - len(before["itl"]) == sum(n - 1 for _, n in runs)  # one gap per token after the first
    assert stats["model"] == "tiny" and stats["max_model_len"] == 256 and stats["reasoning_parser"] is None
    totals = stats["totals"]
    assert totals["generation_tokens_total"] - before["totals"]["generation_tokens_total"] == 15
    assert totals["request_success_total.length"] - before["totals"]["request_success_total.length"] == 3
    now = stats["now"]
    assert now["running"] == 0 and now["waiting"] == 0 and 0 <= now["kv_usage"] <= 1
    assert set(now) >= {"time", "prefix_hit_rate", "prefix_hit_rate_now", "preemptions", "preemptions_total",
                        "spec_acceptance", "spec_acceptance_total", "generation_tps", "prompt_tps"}
    assert stats["series"] and stats["series"][-1] == now
    assert all(a["time"] < b["time"] for a, b in zip(stats["series"], stats["series"][1:]))


def test_history_points_take_the_metrics_deltas():
    from kvserve.entrypoints.openai.metrics import ServerMetrics
    from kvserve.entrypoints.openai.web import DashboardHistory

    m = ServerMetrics("x")
    h = DashboardHistory(m, size=3)
    first = h.sample()
    assert first["preemptions"] == 0 and first["spec_acceptance"] is None and first["prefix_hit_rate_now"] is None
    m.preemptions.inc(2)
    m.spec_draft_tokens.inc(10)
    m.spec_accepted_tokens.inc(7)
    m.prefix_queries.inc(40)
    m.prefix_hits.inc(10)
    m.running.set(3)
    p = h.sample()
    assert (p["preemptions"], p["preemptions_total"], p["spec_acceptance"], p["prefix_hit_rate_now"], p["running"]) == \
        (2, 2, 0.7, 0.25, 3)
    m.spec_draft_tokens.inc(10)
    m.spec_accepted_tokens.inc(1)
    p = h.sample()
    assert p["preemptions"] == 0 and p["spec_acceptance"] == 0.1 and p["spec_acceptance_total"] == 0.4
    h.sample()
    assert len(h.points) == 3  # bounded


def test_chat_template_replaces_the_models(engine):
    with ServerThread(engine, names=["tiny"], chat_template=OTHER_TEMPLATE) as s:
        msgs = [{"role": "user", "content": "The quick brown fox"}]
        got = httpx.post(s.base_url + "/tokenize", json={"messages": msgs}).json()["tokens"]
        want = list(engine.tokenizer.encode("[USER] The quick brown fox\n>>", add_special_tokens=False))
        assert got == want
        r = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="tiny", messages=msgs, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens == len(want)
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE  # the model's own is untouched


def test_generation_defaults_fill_only_the_fields_a_request_leaves_unset(engine):
    defaults = {"max_tokens": 3, "temperature": 0.0, "top_k": 1}
    with ServerThread(engine, names=["tiny"], generation_defaults=defaults) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hello"}]
        body = {"ignore_eos": True}
        r = client.chat.completions.create(model="tiny", messages=msgs, extra_body=body)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        assert client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5,
                                              extra_body=body).usage.completion_tokens == 5
        assert client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=4,
                                              extra_body=body).usage.completion_tokens == 4
        assert client.completions.create(model="tiny", prompt=[5, 6], extra_body=body).usage.completion_tokens == 3
        # temperature 0 from the defaults: greedy, so two unseeded replies agree
        texts = {client.completions.create(model="tiny", prompt=[5, 6], max_tokens=8, extra_body=body).choices[0].text
                 for _ in range(2)}
        assert len(texts) == 1
        # the request's own temperature wins (seeded samples differ from the greedy reply)
        sampled = {client.completions.create(model="tiny", prompt=[5, 6], max_tokens=8, temperature=1.5, seed=i,
                                             extra_body={**body, "top_k": 0}).choices[0].text for i in range(4)}
        assert len(sampled | texts) > 1


@pytest.mark.parametrize("body,words", [
    ({"max_thinking_tokens": 8}, "needs a server started with --reasoning-parser"),
])
def test_thinking_budget_needs_a_reasoning_parser(server, body, words):
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_thinking_tokens" and words in err["message"]


@pytest.mark.parametrize("body,words", [
    ({"max_thinking_tokens": 0}, "must be an integer in [1, 255]"),
    ({"max_thinking_tokens": 256}, "must be an integer in [1, 255]"),
    ({"max_thinking_tokens": "8"}, "valid integer"),
    ({"max_thinking_tokens": 8, "n": 2}, "one reply per request"),
    ({"max_thinking_tokens": 8, "use_beam_search": True, "n": 2}, "one reply per request"),
    ({"max_thinking_tokens": 8, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "forced tool call"),
])
def test_thinking_budget_checks_name_the_field(engine, body, words):
    with ServerThread(engine, names=["tiny"], reasoning_parser="deepseek_r1") as s:
        r = httpx.post(s.base_url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_thinking_tokens" and words in err["message"]
        assert httpx.get(s.base_url + "/dashboard/stats").json()["reasoning_parser"] == "deepseek_r1"


def test_unknown_reasoning_parser_is_refused(engine):
    from kvserve.entrypoints.openai import build_app

    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        build_app(engine, ["tiny"], reasoning_parser="r2")
