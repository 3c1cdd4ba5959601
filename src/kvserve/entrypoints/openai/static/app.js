// kvserve's web page: a chat over /v1/chat/completions (streamed) and a dashboard polling
// /dashboard/stats every second. Plain JS, nothing fetched from outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "stop_strings", "max_thinking_tokens", "json_schema"];
const state = { messages: [], controller: null, model: null, stats: null, tab: "chat", lastAssistant: null };

// ------------------------------------------------------------------ settings
function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem("kvserve.settings") || "{}");
    for (const f of FIELDS) if (saved[f] !== undefined) $(f).value = saved[f];
    $("api-key").value = localStorage.getItem("kvserve.apiKey") || "";
  } catch (e) { /* private mode or bad JSON: defaults */ }
}

function saveSettings() {
  try {
    localStorage.setItem("kvserve.settings", JSON.stringify(Object.fromEntries(FIELDS.map((f) => [f, $(f).value]))));
    localStorage.setItem("kvserve.apiKey", $("api-key").value);
  } catch (e) { /* ignore */ }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function number(id, label, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const v = Number(raw);
  if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) throw new Error(`${label}: ${raw} is not ${integer ? "an integer" : "a number"}`);
  return v;
}

// The request body from the conversation and the settings (Error naming the setting at fault).
function buildRequest() {
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
  messages.push(...state.messages);
  const body = { model: state.model || undefined, messages, stream: true, stream_options: { include_usage: true } };
  const fields = [["temperature", "Temperature", false], ["top_p", "Top-p", false], ["max_tokens", "Max tokens", true],
                  ["seed", "Seed", true], ["max_thinking_tokens", "Max thinking tokens", true]];
  for (const [id, label, integer] of fields) {
    const v = number(id, label, integer);
    if (v !== undefined && (id !== "max_thinking_tokens" || !$("thinking-row").classList.contains("hidden"))) body[id] = v;
  }
  const stops = $("stop_strings").value.split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops;
  const schema = $("json_schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) { throw new Error(`JSON schema: not valid JSON (${e.message})`); }
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: parsed } };
  }
  return body;
}

// ---------------------------------------------------------------------- chat
function bubble(role) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  $("messages").appendChild(el);
  return el;
}

function scrollDown() { const m = $("messages"); m.scrollTop = m.scrollHeight; }

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("retry").disabled = busy || !state.messages.length;
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  bubble("user").textContent = text;
  await generate();
}

// Stream one assistant reply to the conversation: reasoning apart, then the content.
async function generate() {
  let body;
  $("settings-error").textContent = "";
  try { body = buildRequest(); } catch (e) { $("settings-error").textContent = e.message; return; }
  saveSettings();
  const el = bubble("assistant");
  const thinking = document.createElement("details");
  thinking.className = "reasoning hidden";
  thinking.open = true;
  thinking.innerHTML = "<summary>reasoning</summary>";
  const thought = document.createElement("div");
  thinking.appendChild(thought);
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  el.append(thinking, content, meta);
  state.lastAssistant = el;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let first = null, usage = null, finish = null, text = "", reasoning = "", failed = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) {
      let msg = `HTTP ${resp.status}`;
      try { msg = (await resp.json()).error.message || msg; } catch (e) { /* not JSON */ }
      if (resp.status === 401) msg += " (enter the server's API key at the top right)";
      throw new Error(msg);
    }
    const reader = resp.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const c = chunk.choices && chunk.choices[0];
          if (!c) continue;
          const d = c.delta || {};
          if (d.reasoning_content) {
            reasoning += d.reasoning_content;
            thinking.classList.remove("hidden");
            thought.textContent = reasoning;
          }
          if (d.content) { text += d.content; content.textContent = text; }
          if ((d.content || d.reasoning_content) && first === null) first = performance.now();
          if (c.finish_reason) finish = c.finish_reason;
          scrollDown();
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else failed = e.message;
  } finally {
    state.controller = null;
    if (failed !== null) {
      el.classList.add("error");
      content.textContent = (text ? text + "\n" : "") + "error: " + failed;
    }
    if (text || reasoning) state.messages.push({ role: "assistant", content: text });
    const secs = (performance.now() - t0) / 1000;
    const parts = [];
    if (finish) parts.push(finish);
    if (usage) parts.push(`${usage.completion_tokens} tokens`);
    if (first !== null) parts.push(`TTFT ${Charts.fmt((first - t0) / 1000, "s")}`);
    if (usage && first !== null && usage.completion_tokens > 1) {
      parts.push(`${((usage.completion_tokens - 1) / Math.max(1e-3, (performance.now() - first) / 1000)).toFixed(1)} tokens/s`);
    }
    if (!parts.length) parts.push(`${secs.toFixed(2)} s`);
    meta.textContent = parts.join(" · ");
    el.dataset.done = "1";
    setBusy(false);
    scrollDown();
  }
}

function retry() {
  if (state.controller) return;
  const last = state.messages[state.messages.length - 1];
  if (last && last.role === "assistant") state.messages.pop();
  if (state.lastAssistant) state.lastAssistant.remove();
  state.lastAssistant = null;
  if (state.messages.length) generate();
}

function clearChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  state.lastAssistant = null;
  $("messages").innerHTML = "";
  setBusy(false);
}

// ----------------------------------------------------------------- dashboard
const COLORS = { blue: "#2f6fde", orange: "#e07b1a", green: "#2e9d5b", red: "#c62828", purple: "#7c4dcc" };

function showTab(tab) {
  state.tab = tab;
  for (const t of ["chat", "dashboard"]) {
    $("view-" + t).classList.toggle("hidden", t !== tab);
    $("tab-" + t).classList.toggle("active", t === tab);
  }
  if (tab === "dashboard" && state.stats) drawDashboard(state.stats);
}

function series(points, key) { return points.map((p) => [p.time, p[key]]); }

function drawDashboard(s) {
  const now = s.now, reqs = s.requests;
  $("stat-running").textContent = now.running;
  $("stat-waiting").textContent = now.waiting;
  $("stat-kv").textContent = Charts.fmt(now.kv_usage, "%");
  $("stat-prefix").textContent = s.totals["prefix_cache_queries_total"] ? Charts.fmt(now.prefix_hit_rate, "%") : "–";
  $("stat-preemptions").textContent = now.preemptions_total;
  $("stat-spec").textContent = now.spec_acceptance_total === null ? "–" : Charts.fmt(now.spec_acceptance_total, "%");
  $("stat-requests").textContent = reqs.length;
  $("stat-tps").textContent = now.generation_tps.toFixed(1);
  if (state.tab !== "dashboard") return;
  const col = (k) => reqs.map((r) => r[k]);
  Charts.histogram($("chart-ttft"), col("ttft"), { title: "Time to first token", unit: "s", color: COLORS.blue });
  Charts.histogram($("chart-tpot"), col("tpot"), { title: "Time per output token", unit: "s", color: COLORS.green });
  Charts.histogram($("chart-itl"), s.itl, { title: "Inter-token latency", unit: "s", color: COLORS.purple });
  Charts.histogram($("chart-input"), col("prompt_tokens"), { title: "Input length (tokens)", integer: true, color: COLORS.orange });
  Charts.histogram($("chart-output"), col("output_tokens"), { title: "Output length (tokens)", integer: true, color: COLORS.red });
  const pts = s.series, t = s.time;
  Charts.lines($("chart-queue"), [{ name: "running", color: COLORS.blue, points: series(pts, "running") },
                                  { name: "waiting", color: COLORS.orange, points: series(pts, "waiting") }],
               { title: "Requests", now: t });
  Charts.lines($("chart-cache"), [{ name: "KV used", color: COLORS.blue, points: series(pts, "kv_usage") },
                                  { name: "prefix hit (1 s)", color: COLORS.green, points: series(pts, "prefix_hit_rate_now") },
                                  { name: "prefix hit (all)", color: COLORS.purple, points: series(pts, "prefix_hit_rate") }],
               { title: "KV cache", unit: "%", min: 0, max: 1, now: t });
  Charts.lines($("chart-throughput"), [{ name: "output", color: COLORS.red, points: series(pts, "generation_tps") },
                                       { name: "prompt", color: COLORS.orange, points: series(pts, "prompt_tps") }],
               { title: "Tokens per second", unit: "/s", now: t });
  Charts.lines($("chart-preempt"), [{ name: "preemptions", color: COLORS.red, points: series(pts, "preemptions") }],
               { title: "Preemptions per second", now: t });
  Charts.lines($("chart-spec"), [{ name: "accepted (1 s)", color: COLORS.green, points: series(pts, "spec_acceptance") }],
               { title: "Speculative acceptance", unit: "%", min: 0, max: 1, now: t });
  $("dash-status").textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()} · ${reqs.length} recent requests, ${s.itl.length} token gaps`;
}

async function refresh() {
  try {
    const r = await fetch("/dashboard/stats", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const s = await r.json();
    state.stats = s;
    if (!state.model) {
      state.model = s.model;
      $("model-name").textContent = s.model;
      $("thinking-row").classList.toggle("hidden", !s.reasoning_parser);
      if (s.api_key_required && !$("api-key").value) $("api-key").placeholder = "required";
    }
    drawDashboard(s);
  } catch (e) {
    $("dash-status").textContent = "cannot reach the server: " + e.message;
  }
}

// ---------------------------------------------------------------------- wiring
function main() {
  loadSettings();
  $("thinking-row").classList.add("hidden");
  document.querySelectorAll(".tab").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("retry").addEventListener("click", retry);
  $("clear").addEventListener("click", clearChat);
  $("api-key").addEventListener("change", saveSettings);
  FIELDS.forEach((f) => $(f).addEventListener("change", saveSettings));
  window.addEventListener("resize", () => state.stats && drawDashboard(state.stats));
  refresh();
  setInterval(refresh, 1000);
}

main();
