// tracedb run page: polls /api/run and draws its plots as inline SVG (no library).
// A poll passes the watermark of the last answer drawn; the server then answers only
// the watermark and the rejects while nothing arrived, and the plots are redrawn only
// when the watermark moved (or the axis or the bins changed).
"use strict";

const NS = "http://www.w3.org/2000/svg";
const W = 560, H = 240;
const M = { left: 56, right: 14, top: 12, bottom: 34 };

function el(name, attrs, parent, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  const n = Number(v);
  if (Number.isInteger(n) && Math.abs(n) < 1e15) return n.toLocaleString("en-US");
  return n.toPrecision(digits).replace(/(\.\d*?)0+(e|$)/, "$1$2").replace(/\.(e|$)/, "$1");
}

function pct(v) {
  return v === null || v === undefined ? "—" : `${(100 * v).toFixed(1)}%`;
}

// Round tick positions covering [lo, hi].
function ticks(lo, hi, count) {
  const span = hi - lo;
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => span / s <= count) || 10 * mag;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
  return out;
}

function padded(lo, hi) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [0, 1];
  if (lo === hi) return [lo - (Math.abs(lo) || 1) * 0.5, hi + (Math.abs(hi) || 1) * 0.5];
  return [lo, hi];
}

// Clear `svg`, draw the axes for x in xr and y in yr; returns the two scales.
function frame(svg, xr, yr, xlabel, ylabel) {
  svg.replaceChildren();
  const [x0, x1] = padded(...xr);
  const [y0, y1] = padded(...yr);
  const sx = (v) => M.left + ((v - x0) / (x1 - x0)) * (W - M.left - M.right);
  const sy = (v) => H - M.bottom - ((v - y0) / (y1 - y0)) * (H - M.top - M.bottom);
  const grid = el("g", { class: "grid" }, svg);
  for (const t of ticks(y0, y1, 5)) {
    el("line", { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t) }, grid);
    el("text", { x: M.left - 6, y: sy(t) + 4, "text-anchor": "end", class: "tick" }, grid, fmt(t, 3));
  }
  for (const t of ticks(x0, x1, 6)) {
    el("line", { class: "xtick", x1: sx(t), x2: sx(t), y1: H - M.bottom, y2: H - M.bottom + 4 }, grid);
    el("text", { x: sx(t), y: H - M.bottom + 16, "text-anchor": "middle", class: "tick" }, grid, fmt(t, 3));
  }
  el("line", { class: "axis", x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom }, svg);
  el("line", { class: "axis", x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom }, svg);
  el("text", { x: (M.left + W - M.right) / 2, y: H - 4, "text-anchor": "middle", class: "label" }, svg, xlabel);
  el("text", { x: 12, y: M.top + 4, class: "label", transform: `rotate(-90 12 ${M.top + 4})`, "text-anchor": "end" },
    svg, ylabel);
  return { sx, sy };
}

function empty(svg, text) {
  svg.replaceChildren();
  el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg, text);
  svg.dataset.points = "0";
}

// A line through points [{x, y, title}] (null y breaks it), an optional band
// [{x, lo, hi}] behind it; y range yr (default: the data's).
function lineChart(svg, points, { band = null, yr = null, xlabel = "", ylabel = "", cls = "", none = "no data yet" } = {}) {
  const shown = points.filter((p) => p.y !== null && p.y !== undefined);
  if (!shown.length) return empty(svg, none);
  const xs = points.map((p) => p.x);
  const ys = shown.map((p) => p.y).concat(band ? band.flatMap((b) => [b.lo, b.hi]) : []);
  const range = yr || [Math.min(...ys), Math.max(...ys)];
  const { sx, sy } = frame(svg, [Math.min(...xs), Math.max(...xs)], range, xlabel, ylabel);
  if (band && band.length) {
    const top = band.map((b) => `${sx(b.x)},${sy(b.hi)}`);
    const bottom = band.slice().reverse().map((b) => `${sx(b.x)},${sy(b.lo)}`);
    el("polygon", { class: "band", points: top.concat(bottom).join(" ") }, svg);
  }
  let d = "";
  let pen = false;
  for (const p of points) {
    if (p.y === null || p.y === undefined) { pen = false; continue; }
    d += `${pen ? "L" : "M"}${sx(p.x).toFixed(2)},${sy(p.y).toFixed(2)}`;
    pen = true;
  }
  el("path", { class: `line ${cls}`, d }, svg);
  const dots = el("g", { class: "points" }, svg);
  for (const p of shown) {
    const dot = el("circle", { class: "pt", cx: sx(p.x), cy: sy(p.y), r: shown.length > 60 ? 1.6 : 3,
                               "data-x": p.x, "data-y": p.y }, dots);
    el("title", {}, dot, p.title);
  }
  svg.dataset.points = String(shown.length);
}

// Bars [{lo, hi, count}] over x.
function histChart(svg, bars, xlabel) {
  if (!bars.length) return empty(svg, "no scored traces yet");
  const top = Math.max(...bars.map((b) => b.count));
  const { sx, sy } = frame(svg, [bars[0].lo, bars[bars.length - 1].hi], [0, top || 1], xlabel, "traces");
  const g = el("g", { class: "bars" }, svg);
  const single = bars.length === 1 && bars[0].lo === bars[0].hi;
  for (const b of bars) {
    const x0 = single ? sx(b.lo) - 20 : sx(b.lo);
    const x1 = single ? sx(b.hi) + 20 : sx(b.hi);
    const rect = el("rect", { class: "bar", x: x0 + 0.5, width: Math.max(1, x1 - x0 - 1), y: sy(b.count),
                              height: Math.max(0, sy(0) - sy(b.count)), "data-count": b.count }, g);
    el("title", {}, rect, `${fmt(b.lo)} – ${fmt(b.hi)}: ${b.count} traces`);
  }
  svg.dataset.points = String(bars.length);
}

function axisName(by) {
  return by === "seq" ? "seq" : by === "work_step" ? "step" : by.slice(4);
}

function binLabel(b, axis) {
  const name = axisName(axis.by);
  return b.lo === b.hi ? `${name} ${fmt(b.lo)}` : `${name} ${fmt(b.lo)}–${fmt(b.hi)}`;
}

const BANDS = {
  "p10-p90": ["p10–p90", (b) => [b.p10, b.p90]],
  std: ["mean ± std", (b) => [b.mean - b.std, b.mean + b.std]],
  minmax: ["min–max", (b) => [b.min, b.max]],
};

function draw(data, state) {
  const { bins, axis } = data;
  const xlabel = axis.by === "seq" ? "ingest sequence" : axis.by === "work_step" ? "training step" : axis.by.slice(4);
  const at = (b, y, text) => ({ x: b.x, y, title: `${binLabel(b, axis)}: ${text}` });
  const [bandName, bandOf] = BANDS[state.band];
  document.getElementById("band-name").textContent = bandName;
  const scored = bins.filter((b) => b.mean !== null);
  lineChart(document.getElementById("plot-reward"),
    bins.map((b) => at(b, b.mean, `mean ${fmt(b.mean)}, std ${fmt(b.std)}, p10 ${fmt(b.p10)}, p90 ${fmt(b.p90)}, ` +
      `${b.scored} of ${b.traces} scored`)),
    { band: scored.map((b) => { const [lo, hi] = bandOf(b); return { x: b.x, lo, hi }; }), xlabel, ylabel: "reward",
      cls: "mean" });
  const hist = data.histogram;
  histChart(document.getElementById("plot-hist"), hist.bins, "reward");
  document.getElementById("hist-note").textContent = hist.recent
    ? `(latest ${fmt(hist.traces)} traces, ${fmt(hist.scored)} scored)` : `(all ${fmt(hist.scored)} scored traces)`;
  lineChart(document.getElementById("plot-zero"),
    bins.map((b) => at(b, b.zero_variance_share,
      `${b.zero_variance} of ${b.groups_scored} scored groups zero-variance (${b.groups_single} with one scored member)`)),
    { yr: [0, 1], xlabel, ylabel: "share", cls: "zero" });
  lineChart(document.getElementById("plot-tokens"),
    bins.map((b) => at(b, b.tokens_mean, `${fmt(b.tokens_mean)} tokens per trace, ${fmt(b.tokens)} in all`)),
    { yr: [0, Math.max(...bins.map((b) => b.tokens_mean), 1)], xlabel, ylabel: "tokens", cls: "tokens" });
  lineChart(document.getElementById("plot-sampled"),
    bins.map((b) => at(b, b.sampled_share, `${pct(b.sampled_share)} sampled (${fmt(b.sampled)} tokens)`)),
    { yr: [0, 1], xlabel, ylabel: "share", cls: "sampled" });
  const mismatchAt = (b, y) => at(b, y, b.mismatch_tokens
    ? `k3 ${fmt(b.k3_mean)}, ratio mean ${fmt(b.ratio_mean)}, max ${fmt(b.ratio_max)}, ` +
      `${pct(b.outside_share)} outside [1/${fmt(data.mismatch.c)}, ${fmt(data.mismatch.c)}] ` +
      `(${fmt(b.mismatch_tokens)} tokens of ${b.mismatch_traces} traces)`
    : "no token holds both logprobs and trainer_logprobs");
  const none = "no trainer_logprobs written back yet";
  lineChart(document.getElementById("plot-k3"), bins.map((b) => mismatchAt(b, b.k3_mean)),
    { yr: [0, Math.max(...bins.map((b) => b.k3_mean || 0), 1e-3)], xlabel, ylabel: "k3", cls: "k3", none });
  lineChart(document.getElementById("plot-outside"), bins.map((b) => mismatchAt(b, b.outside_share)),
    { yr: [0, 1], xlabel, ylabel: "share", cls: "outside", none });
  const m = data.mismatch;
  document.getElementById("mismatch-note").textContent = m.mismatch_tokens
    ? `(${fmt(m.mismatch_tokens)} tokens of ${fmt(m.mismatch_traces)} traces hold both)` : "";
  lineChart(document.getElementById("plot-dropped"),
    bins.map((b) => at(b, b.dropped_share, `${pct(b.dropped_share)} dropped (${fmt(b.dropped)} of ${fmt(b.traces)} traces)`)),
    { yr: [0, 1], xlabel, ylabel: "share", cls: "dropped" });
  lineChart(document.getElementById("plot-traces"),
    bins.map((b) => at(b, b.traces, `${b.traces} traces, ${b.groups} groups completed here`)),
    { yr: [0, Math.max(...bins.map((b) => b.traces), 1)], xlabel, ylabel: "traces", cls: "traces" });

  const s = data.summary;
  const stat = (key, text) => { document.querySelector(`[data-stat="${key}"]`).textContent = text; };
  stat("watermark", fmt(data.watermark));
  stat("traces", fmt(s.traces));
  stat("groups", fmt(s.groups));
  stat("reward_mean", fmt(s.reward_mean));
  stat("unscored", fmt(s.unscored));
  stat("zero_variance", s.groups_scored ? `${fmt(s.groups_zero_variance)} (${pct(s.zero_variance_share)})` : "—");
  stat("tokens", fmt(s.tokens));
  stat("sampled_share", pct(s.sampled_share));
  stat("mismatch", m.mismatch_tokens ? `${fmt(m.k3_mean)} (${pct(m.outside_share)} outside)` : "—");
  stat("dropped", s.dropped ? `${fmt(s.dropped)} (${pct(s.dropped_share)})` : "0");
  state.age = s.age_s === null ? null : { base: s.age_s, at: performance.now() };

  const note = [];
  if (axis.layout === "width") note.push(`bins of ${fmt(axis.width)} sequence numbers`);
  if (axis.layout === "range") note.push(`${axis.bins} equal ranges of ${fmt(axis.width)}`);
  if (axis.untagged) note.push(`${fmt(axis.untagged)} traces without the tag left out`);
  document.getElementById("axis-note").textContent = note.join(" · ");

  const select = document.getElementById("by");
  const options = ["auto", ...data.axes];
  if (select.options.length !== options.length || options.some((o, i) => select.options[i].value !== o)) {
    select.replaceChildren(...options.map((o) => {
      const opt = document.createElement("option");
      opt.value = o;
      opt.textContent = o === "auto" ? `auto (${axis.requested === "auto" ? axis.by : "step or seq"})` : o;
      return opt;
    }));
  }
  select.value = state.by;

  const rows = data.recent_groups.map((g) => {
    const tr = document.createElement("tr");
    const link = document.createElement("a");
    link.href = `/view/group/${encodeURIComponent(g.group_id)}`;
    link.textContent = g.group_id;
    const first = document.createElement("td");
    first.appendChild(link);
    tr.appendChild(first);
    for (const v of [g.traces, g.scored, fmt(g.mean), fmt(g.std), fmt(g.min), fmt(g.max),
                     g.zero_variance ? "yes" : "no", g.last_seq]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.appendChild(td);
    }
    if (g.zero_variance) tr.classList.add("zero");
    return tr;
  });
  document.querySelector("#groups tbody").replaceChildren(...rows);
}

function showRejects(r) {
  document.querySelector('[data-stat="rejects"]').textContent = fmt(r.total);
  const box = document.getElementById("rejects");
  box.classList.toggle("alert", r.recent > 0);
  box.textContent = r.total
    ? `${fmt(r.total)} rejected lines, ${fmt(r.recent)} in the last ${r.recent_window_s / 60} min; latest: ` +
      `${r.last_reason} (${r.last_source || "?"}:${r.last_line ?? "?"}, ${r.last_at})`
    : "no rejected lines";
}

function showAge(state) {
  if (!state.age) return;
  const s = state.age.base + (performance.now() - state.age.at) / 1000;
  const text = s < 90 ? `${s.toFixed(0)} s` : s < 5400 ? `${(s / 60).toFixed(0)} min` : `${(s / 3600).toFixed(1)} h`;
  document.querySelector('[data-stat="age"]').textContent = text;
}

function main() {
  const config = JSON.parse(document.getElementById("run-config").textContent);
  const state = { by: config.by, bins: config.bins, c: config.mismatch_c, band: "p10-p90", drawn: null, last: null,
                  age: null, timer: null, busy: false, again: false };
  const status = document.getElementById("status");
  const body = document.body;
  body.dataset.draws = "0";
  body.dataset.polls = "0";

  const sync = () => {
    const url = new URL(window.location);
    url.searchParams.set("by", state.by);
    url.searchParams.set("bins", state.bins);
    url.searchParams.set("mismatch_c", state.c);
    history.replaceState(null, "", url);
  };

  async function poll() {
    if (state.busy) { state.again = true; return; }
    state.busy = true;
    clearTimeout(state.timer);
    const params = new URLSearchParams({ by: state.by, bins: state.bins, mismatch_c: state.c });
    if (state.drawn !== null) params.set("after", state.drawn);
    try {
      const response = await fetch(`/api/run?${params}`);
      const answer = await response.json();
      if (!response.ok) {
        status.textContent = answer.detail || `error ${response.status}`;
        status.classList.add("error");
      } else {
        status.classList.remove("error");
        showRejects(answer.rejects);
        if (answer.changed) {
          draw(answer, state);
          state.drawn = answer.watermark;
          state.last = answer;
          body.dataset.draws = String(Number(body.dataset.draws) + 1);
          body.dataset.watermark = String(answer.watermark);
        }
        status.textContent = `watermark ${fmt(answer.watermark)} · checked ${new Date().toLocaleTimeString()}`;
      }
    } catch (e) {
      status.textContent = `server unreachable (${e.message}); retrying`;
      status.classList.add("error");
    } finally {
      body.dataset.polls = String(Number(body.dataset.polls) + 1);
      state.busy = false;
      showAge(state);
      if (state.again) { state.again = false; poll(); } else { state.timer = setTimeout(poll, config.refresh_s * 1000); }
    }
  }

  const redraw = () => { state.drawn = null; sync(); poll(); };  // a full answer, whatever the watermark
  document.getElementById("by").addEventListener("change", (e) => { state.by = e.target.value; redraw(); });
  document.getElementById("bins").addEventListener("change", (e) => {
    const n = Math.round(Number(e.target.value));
    if (!(n >= 1 && n <= config.max_bins)) { e.target.value = state.bins; return; }
    state.bins = n;
    redraw();
  });
  document.getElementById("mismatch-c").addEventListener("change", (e) => {
    const c = Number(e.target.value);
    if (!(Number.isFinite(c) && c >= 1)) { e.target.value = state.c; return; }
    state.c = c;
    redraw();
  });
  document.getElementById("band").addEventListener("change", (e) => {
    state.band = e.target.value;
    if (state.last) draw(state.last, state);
  });
  setInterval(() => showAge(state), 1000);
  poll();
}

main();
