// Tiny canvas charts for the kvserve dashboard: a histogram with percentile marks, and line
// charts over time. No dependencies. Each chart writes what it drew into the canvas's
// data-* attributes (data-count, data-p50, data-last...), which the browser test reads.
"use strict";

const Charts = (() => {
  const INK = "#1d2330", MUTED = "#6b7280", GRID = "#eceef2";

  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 330, h = canvas.clientHeight || 190;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "12px system-ui, sans-serif";
    ctx.textBaseline = "alphabetic";
    return { ctx, w, h };
  }

  // A value in the chart's unit, short: seconds as µs/ms/s, ratios as %, counts as is.
  function fmt(v, unit) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (unit === "s") {
      if (v < 1e-3) return (v * 1e6).toFixed(0) + " µs";
      if (v < 1) return (v * 1e3).toFixed(v < 0.01 ? 2 : v < 0.1 ? 1 : 0) + " ms";
      return v.toFixed(v < 10 ? 2 : 1) + " s";
    }
    if (unit === "%") return (v * 100).toFixed(v < 0.1 ? 1 : 0) + "%";
    if (unit === "/s") return (v >= 100 ? v.toFixed(0) : v.toFixed(1)) + "/s";
    return Math.abs(v) >= 100 || Number.isInteger(v) ? Math.round(v).toString() : v.toFixed(1);
  }

  function quantile(sorted, q) {
    if (!sorted.length) return null;
    const pos = (sorted.length - 1) * q, lo = Math.floor(pos), hi = Math.ceil(pos);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
  }

  // The chart's title, and a second line in grey under it (right).
  function title(ctx, text, right) {
    ctx.fillStyle = INK;
    ctx.font = "600 12px system-ui, sans-serif";
    ctx.fillText(text, 10, 16);
    ctx.font = "12px system-ui, sans-serif";
    if (right) {
      ctx.fillStyle = MUTED;
      ctx.fillText(right, 10, 31);
    }
  }

  // Histogram of `values` (numbers), with p50 / p90 / p99 marked.
  function histogram(canvas, values, opts) {
    const { ctx, w, h } = setup(canvas);
    const unit = opts.unit || "", color = opts.color || "#2f6fde";
    const vals = values.filter((v) => v !== null && v !== undefined && Number.isFinite(v)).sort((a, b) => a - b);
    const p50 = quantile(vals, 0.5), p90 = quantile(vals, 0.9), p99 = quantile(vals, 0.99);
    canvas.dataset.count = vals.length;
    canvas.dataset.p50 = p50 === null ? "" : p50;
    canvas.dataset.max = vals.length ? vals[vals.length - 1] : "";
    title(ctx, opts.title, vals.length ? `n=${vals.length}  p50 ${fmt(p50, unit)}  p90 ${fmt(p90, unit)}  p99 ${fmt(p99, unit)}` : "");
    const L = 36, R = w - 10, T = 40, B = h - 22;
    if (!vals.length) {
      ctx.fillStyle = MUTED;
      ctx.fillText("no requests yet", L, (T + B) / 2);
      return;
    }
    let lo = vals[0], hi = vals[vals.length - 1];
    if (opts.integer) { lo = Math.floor(lo); hi = Math.ceil(hi); }
    if (hi - lo < 1e-12) { const pad = Math.max(Math.abs(hi) * 0.1, opts.integer ? 1 : 1e-4); lo = Math.max(0, lo - pad); hi = hi + pad; }
    let nb = Math.min(opts.bins || 24, Math.max(6, Math.ceil(Math.sqrt(vals.length)) * 2));
    if (opts.integer) nb = Math.max(1, Math.min(nb, hi - lo));
    const counts = new Array(nb).fill(0), width = (hi - lo) / nb;
    for (const v of vals) counts[Math.min(nb - 1, Math.floor((v - lo) / width))]++;
    const cmax = Math.max(...counts);
    ctx.strokeStyle = GRID;
    ctx.beginPath(); ctx.moveTo(L, B + 0.5); ctx.lineTo(R, B + 0.5); ctx.stroke();
    const bw = (R - L) / nb;
    ctx.fillStyle = color;
    counts.forEach((c, i) => {
      if (!c) return;
      const bh = (B - T) * c / cmax;
      ctx.fillRect(L + i * bw + 1, B - bh, Math.max(1, bw - 2), bh);
    });
    const x = (v) => L + (R - L) * (v - lo) / (hi - lo);
    [[p50, "p50"], [p90, "p90"], [p99, "p99"]].forEach(([v, name], i) => {
      ctx.strokeStyle = ["#111827", "#b45309", "#c62828"][i];
      ctx.setLineDash([3, 3]);
      ctx.beginPath(); ctx.moveTo(x(v) + 0.5, T); ctx.lineTo(x(v) + 0.5, B); ctx.stroke();
      ctx.setLineDash([]);
    });
    ctx.fillStyle = MUTED;
    ctx.fillText(String(cmax), 6, T + 10);
    ctx.fillText("0", 6, B);
    ctx.fillText(fmt(lo, unit), L, h - 6);
    const mid = fmt((lo + hi) / 2, unit), end = fmt(hi, unit);
    ctx.fillText(mid, (L + R) / 2 - ctx.measureText(mid).width / 2, h - 6);
    ctx.fillText(end, R - ctx.measureText(end).width, h - 6);
  }

  // Lines over time: series = [{name, color, points: [[unixSeconds, value|null], ...]}].
  // opts: {title, unit, min, max (fixed range; else from the data), window (seconds shown)}.
  function lines(canvas, series, opts) {
    const { ctx, w, h } = setup(canvas);
    const unit = opts.unit || "";
    const now = opts.now || Date.now() / 1000, win = opts.window || 120;
    const L = 44, R = w - 10, T = 40, B = h - 20;
    const shown = series.map((s) => ({ ...s, points: s.points.filter(([t]) => t >= now - win) }));
    const all = shown.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null && Number.isFinite(v));
    let lo = opts.min !== undefined ? opts.min : Math.min(0, ...all);
    let hi = opts.max !== undefined ? opts.max : Math.max(1, ...all);
    if (opts.max === undefined && all.length) hi = Math.max(hi, 1e-9) * 1.1;
    canvas.dataset.points = shown.length ? shown[0].points.length : 0;
    canvas.dataset.last = JSON.stringify(Object.fromEntries(shown.map((s) => {
      const pts = s.points.filter((p) => p[1] !== null);
      return [s.name, pts.length ? pts[pts.length - 1][1] : null];
    })));
    title(ctx, opts.title, "");
    ctx.font = "12px system-ui, sans-serif";
    let lx = 10;
    shown.forEach((s) => {  // legend with the latest value
      const pts = s.points.filter((p) => p[1] !== null);
      const label = `${s.name} ${fmt(pts.length ? pts[pts.length - 1][1] : null, unit)}`;
      ctx.fillStyle = s.color; ctx.fillRect(lx, 24, 10, 3);
      ctx.fillStyle = MUTED; ctx.fillText(label, lx + 14, 30);
      lx += ctx.measureText(label).width + 26;
    });
    const x = (t) => L + (R - L) * (t - (now - win)) / win;
    const y = (v) => B - (B - T) * (v - lo) / (hi - lo || 1);
    ctx.strokeStyle = GRID;
    for (let i = 0; i <= 2; i++) {
      const v = lo + (hi - lo) * i / 2;
      ctx.beginPath(); ctx.moveTo(L, Math.round(y(v)) + 0.5); ctx.lineTo(R, Math.round(y(v)) + 0.5); ctx.stroke();
      ctx.fillStyle = MUTED; ctx.fillText(fmt(v, unit), 4, y(v) + 4);
    }
    ctx.fillText(`−${win} s`, L, h - 4);
    ctx.fillText("now", R - ctx.measureText("now").width, h - 4);
    shown.forEach((s) => {
      ctx.strokeStyle = s.color; ctx.lineWidth = 1.6;
      ctx.beginPath();
      let pen = false;
      for (const [t, v] of s.points) {
        if (v === null || !Number.isFinite(v)) { pen = false; continue; }
        if (pen) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
        pen = true;
      }
      ctx.stroke();
      ctx.lineWidth = 1;
    });
  }

  return { histogram, lines, fmt, quantile };
})();
