"""The web page in a real browser: headless Chromium (Debian's ``chromium`` package) driven by
Playwright, with every request to a host other than this machine's loopback aborted and
recorded (none may be attempted). On the real model (SmolLM2, float32) behind an API key: a
message sent without the key shows the 401, Retry with the key streams the greedy reply
(equal to the offline chat), a second message keeps the conversation, Stop ends a reply; the
dashboard's charts then show those requests. ``/docs`` (Swagger UI) renders offline too.

Screenshots of the chat and the dashboard go to the test's tmp folder (and to
``$KVSERVE_SCREENSHOT_DIR`` when set: the README's pictures in docs/ come from there).

Chromium is not a Python package: ``apt-get install chromium`` (``.ci/run`` installs it when it
is missing). Without it this test fails, saying so, unless ``KVSERVE_SKIP_BROWSER_TESTS=1``.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from server_helpers import ServerThread

from kvserve import SamplingParams
from kvserve.engine.llm_engine import EngineArgs, LLMEngine
from kvserve.engine.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

KEY = "page-test-key"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}


def _chromium() -> str:
    if os.environ.get("KVSERVE_SKIP_BROWSER_TESTS") == "1":
        pytest.skip("KVSERVE_SKIP_BROWSER_TESTS=1: the web page's browser test is NOT run")
    path = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("the browser test needs Debian's Chromium: apt-get install -y chromium (.ci/run does it), "
                    "or set KVSERVE_SKIP_BROWSER_TESTS=1 to skip it")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("the browser test needs playwright (pip install -e '.[test]')")
    return path


@pytest.fixture(scope="module")
def server(smollm2_path):
    engine = LLMEngine(EngineArgs(dtype="float32", max_model_len=1024, kv_cache_memory=0.25))
    # (metrics_public: a browser opening /docs cannot send the key)
    with ServerThread(engine, names=["smollm2"], api_key=KEY, metrics_public=True) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A page whose requests to anything but this machine are aborted and listed in ``page.blocked``."""
    context = browser.new_context(viewport={"width": 1280, "height": 860}, service_workers="block")
    page = context.new_page()
    page.blocked = []

    def gate(route):
        url = urlparse(route.request.url)
        if url.scheme in ("data", "blob") or url.hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            page.blocked.append(route.request.url)
            route.abort()

    context.route("**/*", gate)
    yield page
    context.close()


def _shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    if os.environ.get("KVSERVE_SCREENSHOT_DIR"):
        out = Path(os.environ["KVSERVE_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / name)
    return path


def _reply(page, n: int) -> tuple[str, str]:
    """The text and the stats line of the chat's ``n``-th assistant reply, once it has ended."""
    page.wait_for_function(f"document.querySelectorAll('.msg.assistant[data-done=\"1\"]').length >= {n}")
    reply = page.locator(".msg.assistant").nth(n - 1)
    return reply.locator(".content").inner_text(), reply.locator(".meta").inner_text()


def test_chat_and_dashboard_in_a_browser(server, page, llm_fp32, tmp_path):
    page.goto(server.base_url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent === 'smollm2'")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    page.fill("#seed", "")
    question = "What is the capital of France?"
    # without the key: the server's 401, shown in the chat
    page.fill("#prompt", question)
    page.click("#send")
    text, _ = _reply(page, 1)
    assert "invalid or missing API key" in text and "enter the server's API key" in text
    assert page.locator(".msg.assistant").last.get_attribute("class").split() == ["msg", "assistant", "error"]
    # with the key, Retry: the reply streams in (several partial texts) and equals the offline chat
    page.fill("#api-key", KEY)
    page.evaluate("""() => {
        window.__texts = [];
        new MutationObserver(() => {
            const c = document.querySelectorAll('.msg.assistant .content');
            if (c.length) window.__texts.push(c[c.length - 1].textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.click("#retry")
    text, meta = _reply(page, 1)
    ref = llm_fp32.chat([{"role": "user", "content": question}], SamplingParams(max_tokens=24, temperature=0))
    assert text == ref.text and meta.startswith(f"{ref.finish_reason} · {len(ref.token_ids)} tokens · TTFT")
    partial = [t for t in page.evaluate("window.__texts") if t and t != ref.text]
    assert len(set(partial)) >= 2 and all(ref.text.startswith(t) for t in partial)
    assert page.locator(".msg").count() == 2  # the failed attempt was replaced
    # a second turn keeps the conversation: its prompt is the whole chat so far
    follow = "And of Germany?"
    page.fill("#prompt", follow)
    page.keyboard.press("Enter")  # (Enter sends)
    text2, _ = _reply(page, 2)
    conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": ref.text},
                    {"role": "user", "content": follow}]
    ref2 = llm_fp32.chat(conversation, SamplingParams(max_tokens=24, temperature=0))
    assert text2 == ref2.text
    chat_png = _shot(page, tmp_path, "web-chat.png")

    # the dashboard shows those two requests
    page.click("#tab-dashboard")
    page.wait_for_selector('#chart-ttft[data-count="2"]', timeout=10_000)
    assert page.locator("#stat-requests").inner_text() == "2"
    lengths = [int(float(x)) for x in page.evaluate(
        "() => [...document.querySelectorAll('#chart-input, #chart-output')].map(c => c.dataset.max)")]
    prompt2 = len(apply_chat_template(llm_fp32.tokenizer, conversation))
    assert lengths == [prompt2, max(len(ref.token_ids), len(ref2.token_ids))]
    itl = int(page.get_attribute("#chart-itl", "data-count"))
    assert itl == len(ref.token_ids) - 1 + len(ref2.token_ids) - 1
    assert int(page.get_attribute("#chart-queue", "data-points")) >= 1

    # some load from a client, for the time series; the dashboard follows it
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    prompts = ["Write a haiku about the sea.", "List three fruits.", "What is 2 + 2?", "Name a color.",
               "Say hello in French.", "Describe a cat in one sentence."]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda q: client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=16 + 4 * len(q) % 24,
            temperature=0.7, seed=1), prompts))
    page.wait_for_selector(f'#chart-ttft[data-count="{2 + len(prompts)}"]', timeout=10_000)
    page.set_viewport_size({"width": 1280, "height": 1080})  # (every chart in the picture)
    page.wait_for_timeout(1200)  # one more refresh: the time series' last point
    dash_png = _shot(page, tmp_path, "web-dashboard.png")

    # Stop ends a reply while it streams
    page.click("#tab-chat")
    page.fill("#max_tokens", "400")
    page.fill("#prompt", "Tell me a long story about a dragon.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .content').length === 3 && "
                           "document.querySelectorAll('.msg.assistant .content')[2].textContent.length > 0")
    page.click("#stop")
    _, meta = _reply(page, 3)
    assert meta.startswith("stopped")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    server.wait_idle()

    assert page.blocked == [], page.blocked
    assert chat_png.exists() and dash_png.exists()


def test_api_docs_render_offline(server, page):
    page.goto(server.base_url + "/docs")
    page.get_by_text("/v1/chat/completions", exact=True).first.wait_for(timeout=30_000)
    assert page.locator(".swagger-ui .info .title").inner_text().startswith("kvserve")
    assert page.blocked == [], page.blocked
