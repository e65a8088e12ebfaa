// ar serve: the page. Loads /api/state once, then applies the server's pushes (SSE, /api/events).
// Every piece of text from the records goes in with textContent: a description is an agent's words.
"use strict";
const $ = (id) => document.getElementById(id);
const el = (tag, text, cls) => { const e = document.createElement(tag); if (text !== undefined && text !== null) e.textContent = String(text); if (cls) e.className = cls; return e; };
const fmt = (v, d = 6) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);
const exp4 = (n) => String(n).padStart(4, "0");
let state = { rows: [], curve: [], journal: null, status: {} };
let seen = null, selected = null;

function renderHeader() {
  $("tag").textContent = state.name || "";
  const st = state.status || {};
  const s = $("state");
  s.textContent = st.state || (state.rows.length ? "finished" : "no status");
  s.className = "pill" + (st.state === "running" ? " running" : "");
  s.title = st.why || "";
  const j = state.journal;
  const best = j && j.best;
  const o = state.objective || { name: "val_bpb", unit: "", direction: "min" };
  const better = o.direction === "max" ? "higher" : "lower";
  $("metric").textContent = o.name;
  $("metric").title = `${o.name}${o.unit ? " in " + o.unit : ""}: ${better} is better`;
  $("metric-col").textContent = o.name;
  $("curve").setAttribute("aria-label", `${o.name} per experiment and the best so far (${better} is better)`);
  $("best").textContent = best ? fmt(best.val_bpb) + (o.unit && o.name !== "val_bpb" ? " " + o.unit : "") : "–";
  $("best-at").textContent = best ? `(${exp4(best.exp_id)} ${best.commit})` : "";
  const counts = {};
  for (const r of state.rows) counts[r.status] = (counts[r.status] || 0) + 1;
  $("counts").textContent = `${state.rows.length} experiments · ` + Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(" · ");
}

function stepCells(step) {
  if (!step) return ["–", "–", "–", "–"];
  return [`${step.step} (${fmt(step.pct, 1)}%)`, fmt(step.loss, 4), step.mfu == null ? "–" : fmt(step.mfu, 1) + "%", `${step.remaining_s}s`];
}

function renderNow() {
  const st = state.status || {};
  const body = $("now-body");
  body.replaceChildren();
  const slots = st.slots;
  $("slots").hidden = !slots;
  if (slots) {
    const tb = $("slots").tBodies[0];
    tb.replaceChildren();
    for (const s of slots) {
      const tr = el("tr");
      const x = s.experiment;
      tr.append(el("td", s.label || s.slot), el("td", x ? `${exp4(x.id)} ${x.description || x.kind}` : "idle", "desc"), el("td", x ? x.phase : ""));
      for (const c of stepCells(s.step)) tr.append(el("td", c));
      tb.append(tr);
    }
    body.textContent = st.state === "running" ? "" : "not running";
    return;
  }
  const x = st.experiment;
  if (!x) {
    const last = state.rows[state.rows.length - 1];
    body.className = "dim";
    body.textContent = (st.state === "running" ? "between experiments" : "nothing running") +
      (last ? ` · last: ${exp4(last.exp_id)} ${last.status} ${fmt(last.val_bpb)} — ${last.description}` : "");
    return;
  }
  body.className = "";
  const title = el("div");
  title.append(el("b", exp4(x.id) + " "), el("span", x.description || x.kind), el("span", " · " + x.phase, "dim"));
  const p = st.step;
  const bar = el("div", null, "bar"); const fill = el("div"); fill.style.width = (p ? Math.min(100, p.pct) : 0) + "%"; bar.append(fill);
  const kv = el("div", null, "kv");
  const cells = stepCells(p);
  for (const [k, v] of [["step", cells[0]], ["loss", cells[1]], ["MFU", cells[2]], ["tok/s", p ? Math.round(p.tokens_per_s).toLocaleString() : "–"], ["time left", cells[3]]]) {
    const d = el("div", k, "dim"); d.append(el("b", v)); kv.append(d);
  }
  body.append(title, bar, kv);
}

function renderCurve() {
  const svg = $("curve"); const NS = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const pts = state.curve; if (!pts.length) { const t = document.createElementNS(NS, "text"); t.setAttribute("x", 10); t.setAttribute("y", 20); t.textContent = "no scores yet"; svg.append(t); return; }
  const W = 600, H = 220, L = 56, R = 10, T = 10, B = 24;
  const ys = pts.map((p) => p.val_bpb);
  let lo = Math.min(...ys), hi = Math.max(...ys); if (hi - lo < 1e-9) { hi += 0.01; lo -= 0.01; }
  const maxX = Math.max(...pts.map((p) => p.exp_id)), minX = Math.min(...pts.map((p) => p.exp_id));
  const sx = (x) => L + (maxX === minX ? (W - L - R) / 2 : (x - minX) / (maxX - minX) * (W - L - R));
  const sy = (y) => T + (hi - y) / (hi - lo) * (H - T - B);
  for (const v of [lo, (lo + hi) / 2, hi]) { const t = document.createElementNS(NS, "text"); t.setAttribute("x", 2); t.setAttribute("y", sy(v) + 4); t.textContent = fmt(v, 4); svg.append(t); }
  const line = document.createElementNS(NS, "polyline");
  const steps = []; for (const p of pts) if (p.best !== null) { if (steps.length) steps.push(`${sx(p.exp_id)},${steps[steps.length - 1].split(",")[1]}`); steps.push(`${sx(p.exp_id)},${sy(p.best)}`); }
  line.setAttribute("points", steps.join(" ")); line.setAttribute("fill", "none"); line.setAttribute("stroke", "#4cc38a"); line.setAttribute("stroke-width", "2");
  svg.append(line);
  for (const p of pts) {
    const c = document.createElementNS(NS, "circle");
    c.setAttribute("cx", sx(p.exp_id)); c.setAttribute("cy", sy(p.val_bpb)); c.setAttribute("r", 3.5);
    c.setAttribute("fill", p.status === "keep" ? "#4cc38a" : "#8a93a3");
    const t = document.createElementNS(NS, "title"); t.textContent = `${exp4(p.exp_id)} ${p.status} ${fmt(p.val_bpb)}`; c.append(t);
    svg.append(c);
  }
}

function renderResults(fresh) {
  const tb = $("results").tBodies[0];
  tb.replaceChildren();
  const entries = new Map(((state.journal && state.journal.entries) || []).map((e) => [e.exp_id, e]));
  for (const r of [...state.rows].reverse()) {
    const e = entries.get(r.exp_id) || {};
    const tr = el("tr"); tr.dataset.exp = r.exp_id;
    if (fresh.has(r.exp_id)) tr.classList.add("fresh");
    if (selected === r.exp_id) tr.classList.add("selected");
    tr.append(el("td", exp4(r.exp_id)), el("td", r.commit || "–"), el("td", r.status, r.status), el("td", fmt(r.val_bpb)),
              el("td", e.delta == null ? "–" : (e.delta > 0 ? "+" : "") + fmt(e.delta)), el("td", r.mfu == null ? "–" : fmt(r.mfu, 1)));
    const d = el("td", r.description, "desc");
    if (r.reason && r.status !== "keep") d.append(el("div", r.reason, "dim"));
    tr.append(d);
    tr.addEventListener("click", () => openDiff(r.exp_id));
    tb.append(tr);
  }
}

async function openDiff(exp) {
  selected = exp;
  for (const tr of $("results").tBodies[0].rows) tr.classList.toggle("selected", Number(tr.dataset.exp) === exp);
  $("diff-panel").hidden = false;
  $("diff-title").textContent = exp4(exp);
  const pre = $("diff"); pre.replaceChildren(el("span", "loading…", "dim"));
  const res = await fetch(`/api/diff/${exp}`);
  const text = res.ok ? await res.text() : "";
  pre.replaceChildren();
  if (!text) { pre.append(el("span", "no diff recorded for this experiment", "dim")); return; }
  for (const line of text.split("\n")) {
    const cls = line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del" : line.startsWith("@@") ? "hunk" : "";
    pre.append(el("span", line + "\n", cls));
  }
}

function renderJournal() {
  const box = $("journal"); box.replaceChildren();
  const j = state.journal; if (!j) return;
  const byId = new Map(j.entries.map((e) => [e.exp_id, e]));
  const list = (title, items) => {
    box.append(el("b", title)); const ul = el("ul");
    if (!items.length) ul.append(el("li", "(none)", "dim"));
    for (const it of items) ul.append(el("li", it));
    box.append(ul);
  };
  box.append(el("div", `noise threshold ${j.noise} (${j.noise_source}); ${j.since_keep} proposal(s) since the last keep. Ideas are the proposers' own words.`, "dim"));
  list("Near misses", j.near_misses.map((id) => { const e = byId.get(id); return `${exp4(id)} ${fmt(e.val_bpb)} (${e.delta >= 0 ? "+" : ""}${fmt(e.delta)}): ${e.change} — ${e.idea}`; }));
  list("Dead ends, by idea", Object.entries(j.dead_ends).map(([g, ids]) => `${g}: ` + ids.map((id) => { const e = byId.get(id); return `${exp4(id)} (${e.status}${e.delta == null ? "" : " " + (e.delta >= 0 ? "+" : "") + fmt(e.delta, 4)})`; }).join(", ")));
  list("Strategy switches", j.switches.map((s) => `${exp4(s.exp_id)}: ${s.strategy} (after ${s.since_keep} without a keep)`));
  list("Refused repeats", j.refused.map((id) => `${exp4(id)}: ${byId.get(id).reason}`));
}

function apply(kind, doc) {
  let fresh = new Set();
  if (kind === "status") { state.status = doc; }
  else {
    if (seen) for (const r of doc.rows || []) if (!seen.has(r.exp_id)) fresh.add(r.exp_id);
    Object.assign(state, { rows: doc.rows || [], curve: doc.curve || [], journal: doc.journal || null,
                           objective: doc.objective || state.objective });
    seen = new Set(state.rows.map((r) => r.exp_id));
  }
  renderHeader(); renderNow();
  if (kind !== "status") { renderCurve(); renderResults(fresh); renderJournal(); }
}

async function start() {
  const res = await fetch("/api/state");
  const doc = await res.json();
  state.name = doc.name;
  apply("status", doc.status || {});
  apply("results", doc);
  const es = new EventSource("/api/events");
  es.addEventListener("open", () => { $("conn").textContent = "live"; $("conn").className = "pill live"; });
  es.addEventListener("error", () => { $("conn").textContent = "reconnecting"; $("conn").className = "pill offline"; });
  es.addEventListener("status", (m) => apply("status", JSON.parse(m.data)));
  es.addEventListener("results", (m) => apply("results", JSON.parse(m.data)));
}
start();
