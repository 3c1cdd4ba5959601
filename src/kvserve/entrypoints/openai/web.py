"""The server's web page and offline API docs.

- ``GET /``: a chat page and a live dashboard (``static/index.html``, plain HTML/JS with
  canvas charts, no CDN: every asset is in this package). The chat talks to
  ``/v1/chat/completions`` like any client (with the API key typed into the page, when the
  server has one); the dashboard polls ``GET /dashboard/stats`` every second.
- ``GET /dashboard/stats``: JSON for the dashboard: the server's metrics now, their history
  (one point a second for the last :data:`HISTORY_POINTS` seconds: running and waiting
  requests, KV usage, prefix-cache hit rate, preemptions, speculative acceptance, token
  throughput) and the recent finished requests (prompt and output lengths, TTFT, TPOT, E2E,
  queue time) and inter-token gaps, for the distributions. Like ``/metrics`` it needs no API key
  and holds no text of any request.
- ``GET /docs``: FastAPI's Swagger UI page with its script and style served from the
  ``fastapi-offline`` package instead of a CDN (no validator badge is fetched). There is no
  ``/redoc``: ReDoc's script loads its logo from its makers' CDN.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

if TYPE_CHECKING:
    from kvserve.entrypoints.openai.api import OpenAIServer
    from kvserve.entrypoints.openai.metrics import ServerMetrics

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: seconds of history the dashboard's time series keep (one point a second)
HISTORY_POINTS = 600


def docs_assets_dir() -> Path:
    """The folder of Swagger UI's files (``swagger-ui-bundle.js``, ``swagger-ui.css``,
    ``favicon.png``) in the ``fastapi-offline`` package."""
    return Path(str(importlib.resources.files("fastapi_offline") / "static"))


class DashboardHistory:
    """The dashboard's time series: every ``interval`` seconds, a point from the server's
    :class:`~kvserve.entrypoints.openai.metrics.ServerMetrics` (see :meth:`sample`).

    Args:
        metrics: the server's metrics.
        size: the most points kept (the oldest are dropped).
    """

    def __init__(self, metrics: "ServerMetrics", size: int = HISTORY_POINTS) -> None:
        self.metrics = metrics
        self.points: deque = deque(maxlen=size)
        self._last: Optional[tuple[float, dict]] = None
        self._task: Optional[asyncio.Task] = None

    def sample(self) -> dict:
        """Append and return one point: ``time`` (Unix s); gauges ``running``, ``waiting``,
        ``kv_usage`` and ``prefix_hit_rate`` (0..1, over the server's life); over the interval
        since the previous point: ``prefix_hit_rate_now`` (None without prompt tokens),
        ``preemptions``, ``spec_acceptance`` (accepted / proposed draft tokens, None without
        drafts), ``prompt_tps`` and ``generation_tps`` (tokens/s), ``requests_finished``; and
        the totals ``preemptions_total``, ``spec_acceptance_total``."""
        now, v = time.time(), self.metrics.values()
        prev_t, prev = self._last if self._last is not None else (now, v)
        dt = max(now - prev_t, 1e-9)

        def delta(name: str) -> float:
            return v.get(name, 0.0) - prev.get(name, 0.0)

        def ratio(num: float, den: float) -> Optional[float]:
            return num / den if den > 0 else None

        finished = sum(val for k, val in v.items() if k.startswith("request_success_total.")) - \
            sum(val for k, val in prev.items() if k.startswith("request_success_total."))
        point = {
            "time": round(now, 3),
            "running": v.get("num_requests_running", 0.0),
            "waiting": v.get("num_requests_waiting", 0.0),
            "kv_usage": v.get("kv_cache_usage_perc", 0.0),
            "prefix_hit_rate": v.get("prefix_cache_hit_rate", 0.0),
            "prefix_hit_rate_now": ratio(delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")),
            "preemptions": delta("num_preemptions_total"),
            "preemptions_total": v.get("num_preemptions_total", 0.0),
            "spec_acceptance": ratio(delta("spec_decode_num_accepted_tokens_total"),
                                     delta("spec_decode_num_draft_tokens_total")),
            "spec_acceptance_total": ratio(v.get("spec_decode_num_accepted_tokens_total", 0.0),
                                           v.get("spec_decode_num_draft_tokens_total", 0.0)),
            "prompt_tps": delta("prompt_tokens_total") / dt if self._last is not None else 0.0,
            "generation_tps": delta("generation_tokens_total") / dt if self._last is not None else 0.0,
            "requests_finished": finished,
        }
        self._last = (now, v)
        self.points.append(point)
        return point

    def start(self, interval: float = 1.0) -> None:
        """Sample every ``interval`` seconds on the running event loop until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval))

    async def _run(self, interval: float) -> None:
        while True:
            self.sample()
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def add_web_routes(app: FastAPI, server: "OpenAIServer") -> DashboardHistory:
    """Add ``/``, ``/static``, ``/dashboard/stats`` and ``/docs`` to ``app`` (built with
    ``docs_url=None, redoc_url=None``).

    Returns:
        The :class:`DashboardHistory` to start and stop with the app's lifespan.
    """
    history = DashboardHistory(server.metrics)
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
    app.mount("/docs-assets", StaticFiles(directory=str(docs_assets_dir())), name="docs-assets")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/stats", summary="The web dashboard's data: metrics now, their history, recent requests")
    async def dashboard_stats():
        if not history.points or time.time() - history.points[-1]["time"] > 1.5:
            history.sample()  # (the sampler is not running: an app used without its lifespan)
        requests, itl = server.metrics.recent()
        return {"model": server.model_name, "max_model_len": server.max_model_len,
                "reasoning_parser": server.reasoning_parser_cls.name if server.reasoning_parser_cls else None,
                "api_key_required": server.api_key is not None, "time": time.time(),
                "now": history.points[-1], "series": list(history.points), "requests": requests, "itl": itl,
                "totals": server.metrics.values()}

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=app.swagger_ui_oauth2_redirect_url,
                                   swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-assets/swagger-ui.css",
                                   swagger_favicon_url="/docs-assets/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})

    @app.get(app.swagger_ui_oauth2_redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    return history
