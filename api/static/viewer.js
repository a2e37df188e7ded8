// tracedb trace viewer: builds one heat-strip cell per token and colours it by
// advantage (diverging, null hatched, unsampled grey) or logprob (sequential).
// The trace page (#trace-data: one strip per node of the page, found by its `strip`:
// the node index) and the group page (#group-data: one strip per branch of each member,
// a window of it from `offset`, found by its position) share it.
"use strict";

const WHITE = [255, 255, 255];
const POSITIVE = [178, 24, 43];
const NEGATIVE = [33, 102, 172];
const LOGPROB = [84, 39, 143];

function mix(end, t) {
  const c = WHITE.map((w, i) => Math.round(w + (end[i] - w) * Math.min(1, Math.max(0, t))));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

// The colour of one value: advantages on a symmetric scale around 0, logprobs from 0 down.
function colorOf(mode, value, scale) {
  if (mode === "logprob") return mix(LOGPROB, -value / scale);
  return value >= 0 ? mix(POSITIVE, value / scale) : mix(NEGATIVE, -value / scale);
}

function scaleOf(nodes, mode) {
  let top = 0;
  for (const n of nodes) {
    const values = mode === "logprob" ? n.logprobs : n.advantages;
    if (!values) continue;
    for (let i = 0; i < values.length; i++) {
      if (!n.sampled_mask[i]) continue;
      const v = mode === "logprob" ? -values[i] : Math.abs(values[i]);
      if (v > top) top = v;
    }
  }
  return top > 0 ? top : 1;
}

function fmt(v) {
  return v === null || v === undefined ? "null" : Number(v).toPrecision(4).replace(/\.?0+$/, "");
}

function stripOf(node, index) {
  return document.querySelector(`.strip[data-node="${node.strip ?? index}"]`);
}

function build(data) {
  for (const [index, node] of data.nodes.entries()) {
    const strip = stripOf(node, index);
    if (!strip) continue;
    const frag = document.createDocumentFragment();
    for (let i = 0; i < node.token_ids.length; i++) {
      const cell = document.createElement("span");
      cell.className = "t";
      if (node.pieces) {
        cell.textContent = node.pieces[i].replace(/\n/g, "↵");
        cell.classList.add("piece");
      }
      frag.appendChild(cell);
    }
    strip.replaceChildren(frag);
  }
}

function paint(data, mode) {
  const scale = scaleOf(data.nodes, mode);
  for (const [index, node] of data.nodes.entries()) {
    const strip = stripOf(node, index);
    if (!strip) continue;
    const values = mode === "logprob" ? node.logprobs : node.advantages;
    const cells = strip.children;
    for (let i = 0; i < cells.length; i++) {
      const cell = cells[i];
      const sampled = node.sampled_mask[i];
      cell.classList.remove("off", "null", "dark");
      cell.style.backgroundColor = "";
      let label;
      if (!sampled) {
        cell.classList.add("off");
        label = "unsampled";
      } else if (values === null || values === undefined) {
        cell.classList.add("null");
        label = `${mode}: null (never assigned)`;
      } else {
        cell.style.backgroundColor = colorOf(mode, values[i], scale);
        const strength = mode === "logprob" ? -values[i] / scale : Math.abs(values[i]) / scale;
        if (strength > 0.55) cell.classList.add("dark");  // keep decoded text readable
        label = `${mode}: ${fmt(values[i])}`;
      }
      cell.dataset.value = sampled && values ? String(values[i]) : sampled ? "null" : "off";
      const piece = node.pieces ? ` ${JSON.stringify(node.pieces[i])}` : "";
      cell.title = `token ${i + (node.offset || 0)} · id ${node.token_ids[i]}${piece} · ${label}`;
    }
  }
  const legend = document.getElementById("legend");
  // Built as elements (no inline style attributes: the pages' content security policy forbids them).
  const swatches = mode === "logprob"
    ? [[mix(LOGPROB, 0), "0"], [mix(LOGPROB, 1), fmt(-scale)], ["off", "unsampled"]]
    : [[mix(NEGATIVE, 1), fmt(-scale)], [mix(POSITIVE, 0), "0"], [mix(POSITIVE, 1), `+${fmt(scale)}`],
       ["null", "null"], ["off", "unsampled"]];
  legend.replaceChildren();
  for (const [color, text] of swatches) {
    const swatch = document.createElement("span");
    swatch.className = color === "off" || color === "null" ? `swatch ${color}` : "swatch";
    if (swatch.className === "swatch") swatch.style.background = color;
    legend.append(swatch, `${text} `);
  }
  document.body.dataset.painted = `${mode}:${data.credit}`;
}

async function switchCredit(data, credit, mode) {
  const status = document.getElementById("status");
  status.textContent = "loading…";
  const id = encodeURIComponent(data.trace_id);
  const q = `credit=${encodeURIComponent(credit)}`;
  // Only what this page shows: its nodes, its window of branches.
  const nodes = data.nodes.map((n) => `node=${n.node_index}`).join("&");
  const span = `branches_from=${data.branches_from}&limit=${data.branch_limit}`;
  const [trace, branches] = await Promise.all([
    fetch(`/traces/${id}?tokens=true&${q}&${nodes}`).then((r) => r.json()),
    fetch(`/traces/${id}/branches?${q}&${span}`).then((r) => r.json()),
  ]);
  const byIndex = new Map(trace.nodes.map((n) => [n.node_index, n]));
  for (const node of data.nodes) {
    const values = byIndex.get(node.node_index).tokens.advantages;
    node.advantages = values ? values.slice(0, node.token_ids.length) : null;  // the strip's window
  }
  for (const b of branches.branches) {
    const row = document.querySelector(`#branch-table tr[data-branch="${b.branch_index}"] .credit-status`);
    if (row) row.textContent = b.credit_status;
  }
  data.credit = credit;
  paint(data, mode);
  status.textContent = "";
}

// The turn summary's chips: each sampled node's mean advantage on the summary's own scale.
function paintTurns(summary) {
  const chips = document.getElementById("turn-chips");
  if (!chips || !summary) return;
  const scale = summary.scale || 1;
  const byNode = new Map(summary.turns.map((u) => [u.node_index, u]));
  for (const chip of chips.querySelectorAll(".turn")) {
    const u = byNode.get(Number(chip.dataset.node));
    chip.classList.remove("null", "dark");
    chip.style.backgroundColor = "";
    if (!u || u.mean === null) {
      chip.classList.add("null");
      chip.title = `turn ${chip.dataset.turn} · node ${chip.dataset.node} · unassigned`;
      chip.dataset.value = "null";
      continue;
    }
    chip.style.backgroundColor = colorOf("advantage", u.mean, scale);
    if (Math.abs(u.mean) / scale > 0.55) chip.classList.add("dark");
    chip.dataset.value = String(u.mean);
    chip.title = `turn ${u.turn} · node ${u.node_index} · ${u.n_sampled} sampled tokens · mean ${fmt(u.mean)}` +
      ` · min ${fmt(u.min)} · max ${fmt(u.max)} · sum ${fmt(u.sum)}`;
  }
  for (const row of document.querySelectorAll("#turn-table tbody tr")) {
    const u = byNode.get(Number(row.dataset.node));
    if (!u) continue;
    for (const key of ["mean", "min", "max", "sum"]) {
      const cell = row.querySelector(`[data-figure="${key}"]`);
      cell.textContent = key === "mean" && !u.assigned ? "unassigned" : u[key] === null ? "—" : fmt(u[key]);
    }
  }
  document.body.dataset.turns = summary.credit || "";
}

async function switchTurns(data, credit) {
  if (!document.getElementById("turn-chips")) return;
  const id = encodeURIComponent(data.trace_id);
  const summary = await fetch(`/traces/${id}/turns?credit=${encodeURIComponent(credit)}`).then((r) => r.json());
  summary.credit = credit;
  for (const el of document.querySelectorAll(".turn-set")) el.textContent = credit;
  paintTurns(summary);
}

function showBranch(value) {
  for (const node of document.querySelectorAll("article.node")) {
    const on = value === "all" || node.dataset.branches.split(",").includes(value);
    node.hidden = !on;
  }
}

function traceMain() {
  const data = JSON.parse(document.getElementById("trace-data").textContent);
  const color = document.getElementById("color");
  const credit = document.getElementById("credit");
  const branch = document.getElementById("branch");
  const sync = () => {
    const url = new URL(window.location);
    url.searchParams.set("color", color.value);
    url.searchParams.set("credit", credit.value);
    history.replaceState(null, "", url);
    const link = document.getElementById("compare-link");
    if (link) {  // compare the set shown with another one
      const target = new URL(link.href);
      const other = Array.from(credit.options).map((o) => o.value).find((v) => v !== credit.value);
      target.searchParams.set("credit", credit.value);
      target.searchParams.set("compare", other);
      link.href = target.pathname + target.search;
    }
    for (const pager of document.querySelectorAll(".pager a, #node-filter a")) {  // other pages keep the set and colour shown
      const target = new URL(pager.href);
      target.searchParams.set("color", color.value);
      target.searchParams.set("credit", credit.value);
      pager.href = target.pathname + target.search;
    }
  };
  build(data);
  paint(data, color.value);
  data.turns.credit = data.credit;
  paintTurns(data.turns);
  color.addEventListener("change", () => { paint(data, color.value); sync(); });
  credit.addEventListener("change", () => Promise.all([
    switchCredit(data, credit.value, color.value), switchTurns(data, credit.value),
  ]).then(sync));
  branch.addEventListener("change", () => showBranch(branch.value));
  const wanted = new URL(window.location).searchParams.get("branch");  // links from the group page
  if (wanted !== null && Array.from(branch.options).some((o) => o.value === wanted)) {
    branch.value = wanted;
    showBranch(wanted);
  }
}

// Pages of strips without per-trace switching: the group page and the credit comparison.
// Colour repaints in place; a select marked data-submit (a credit set) reloads the page.
function stripsMain(id) {
  const data = JSON.parse(document.getElementById(id).textContent);
  const color = document.getElementById("color");
  build(data);
  paint(data, color.value);
  color.addEventListener("change", () => {
    paint(data, color.value);
    const url = new URL(window.location);
    url.searchParams.set("color", color.value);
    history.replaceState(null, "", url);
  });
  for (const select of document.querySelectorAll("select[data-submit]")) {
    select.addEventListener("change", () => select.form.submit());  // another set: other strips, other statuses
  }
}

if (document.getElementById("trace-data")) traceMain();
else if (document.getElementById("group-data")) stripsMain("group-data");
else if (document.getElementById("compare-data")) stripsMain("compare-data");
