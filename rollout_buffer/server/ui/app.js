// rollout-buffer dashboard: plain JavaScript, no build step, nothing loaded from elsewhere.
// Live numbers arrive as server-sent events on /ui/api/events, read with fetch so the bearer token can be
// sent (EventSource cannot send headers); everything else is read-only JSON under /ui/api/.
"use strict";

const TOKEN_KEY = "rollout-buffer-token";
const HISTORY = 2000; // points kept per chart
const MAX_SESSIONS = 10; // open sessions whose branch trees the page shows
const WINDOW_S = 1800; // what the charts span: the last half hour
// The line charts: the unit of their y axis, digits shown, and whether the values are counts (whole ticks).
// `empty`: what would fill the chart, shown while it has no point.
const CHARTS = {
  reward: { unit: "reward (raw)", digits: 3, whole: false, zero: false,
            empty: "no trajectory of this run has finished yet" },
  throughput: { unit: "trajectories/s", digits: 1, whole: false, empty: "no run is generating" },
  inflight: { unit: "trajectories", digits: 0, whole: true, empty: "no run is generating" },
  lag: { unit: "versions", digits: 0, whole: true,
         empty: "no trainer version yet: the trainer reports it with current_version (the slime adapter does) " +
                "or POST /trainer_version" },
  latency: { unit: "ms", digits: 0, whole: false, empty: "no engine request yet" },
};
const MAX_BATCHES = 4; // the newest delivered batches drawn side by side
const $ = (id) => document.getElementById(id);

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  stream: null, // AbortController of the running event stream
  runId: null,
  last: null, // previous snapshot, for rates
  history: { reward: [], throughput: [], inflight: [], lag: [], latency: [] }, // [time, value] per series
  lastPoint: null,
  chartRun: null, // the run the series hold: the charts show one run
  countsKey: "",
  page: { next: null, newest: 0, seq: 0, empty: true },
  snapshots: 0,
};

// ---- DOM helpers ---------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}
const svgEl = (tag, attrs) => {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
};
const fmt = (x, digits = 2) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits));
const short = (s, n = 18) => (s && s.length > n ? s.slice(0, n) + "…" : s || "");
const when = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}
function setConn(kind, text) {
  $("conn").className = "conn " + kind;
  $("conn").textContent = text;
}

// ---- API -----------------------------------------------------------------------------------------
class AuthError extends Error {}

async function api(path, init = {}) {
  const headers = new Headers(init.headers || {});
  if (state.token) headers.set("Authorization", "Bearer " + state.token);
  const resp = await fetch(path, { ...init, headers });
  if (resp.status === 401) {
    const body = await resp.json().catch(() => ({}));
    throw new AuthError(`401 ${body.message || "unauthorized"}`);
  }
  return resp;
}
async function getJSON(path) {
  const resp = await api(path);
  const body = await resp.json();
  if (!resp.ok) throw new Error(`${resp.status} ${body.message || resp.statusText}`);
  return body;
}
function failed(err) {
  if (err instanceof AuthError) {
    stopStream();
    setConn("bad", "rejected");
    showError(`The server rejected the token (${err.message}). Enter the server's --auth-token.`);
  } else if (err.name !== "AbortError") {
    showError(String(err.message || err));
  }
}

// ---- the live stream -----------------------------------------------------------------------------
function stopStream() {
  if (state.stream) state.stream.abort();
  state.stream = null;
}

async function runStream() {
  stopStream();
  const ctl = new AbortController();
  state.stream = ctl;
  try {
    const resp = await api("/ui/api/events", { signal: ctl.signal });
    if (!resp.ok) throw new Error(`${resp.status} on the event stream`);
    setConn("on", "live");
    showError("");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const event = parseEvent(block);
        if (event.name === "snapshot") onSnapshot(JSON.parse(event.data));
        else if (event.name === "history") onHistory(JSON.parse(event.data).points);
      }
    }
  } catch (err) {
    if (err instanceof AuthError) return failed(err);
    if (err.name === "AbortError") return;
    setConn("off", "reconnecting");
  }
  // The server ends a stream after a while (or restarted): reconnect unless this stream was replaced.
  if (state.stream === ctl) setTimeout(() => state.stream === ctl && runStream(), 2000);
}

function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
  }
  return { name, data: data.join("\n") };
}

// ---- snapshot → panels ---------------------------------------------------------------------------
function onSnapshot(s) {
  state.snapshots += 1;
  const run = s.run;
  const runChanged = (run && run.run_id) !== state.runId;
  state.runId = run ? run.run_id : null;
  renderRun(s);
  addPoint(pointOf(s));
  drawCharts();
  const key = JSON.stringify([s.groups, s.filtered, s.records]);
  if (key !== state.countsKey || runChanged) {
    state.countsKey = key;
    refreshBatches();
    refreshReasons(s);
  }
  state.last = s;
  if (runChanged || state.snapshots % 5 === 1) {
    refreshRuns();
    refreshSessions();
  }
  if (runChanged) search();
  else if (s.latest_rowid > state.page.newest) {
    // An empty list fills itself as trajectories arrive; a list being read is not moved under the reader.
    if (state.page.empty) search();
    else $("newer").hidden = false;
  }
}

function renderRun(s) {
  const run = s.run;
  const counts = $("run-counts");
  counts.replaceChildren();
  // Why the run failed, engines that stopped answering, a store serving reads only or that refused a write lately
  // (a full disk): what an operator must act on.
  const refused = (s.store || {}).last_refusal;
  const outage = run && run.state === "running" ? (run.progress || {}).engine_outage : null;
  const alerts = [
    run && run.state === "failed" && run.error ? `run failed: ${run.error}` : "",
    outage ? `engine outage for ${Math.round(outage.seconds)} s (of ${outage.budget_s} s before the run fails): ` +
      `${(outage.engines || []).join(", ")} (${outage.error}); generation waits for them` : "",
    (s.store || {}).degraded ? `serving reads only: ${s.store.degraded}` : "",
    refused ? `the store refused a write ${Math.max(0, Math.round(s.t - refused.at))} s ago: ${refused.error}` : "",
  ].filter(Boolean);
  $("run-alert").textContent = alerts.join("\n");
  $("run-alert").hidden = !alerts.length;
  if (!run) {
    $("run-head").textContent = "no run yet";
    return;
  }
  const p = run.progress || {};
  const control = s.control || {};
  const admission = (control.admission || {}).state;
  $("run-head").replaceChildren(
    el("strong", { id: "run-id", class: "run-id", title: run.run_id }, run.run_id),
    ` · ${run.task_type || "writer"} · `,
    el("span", { id: "run-state" }, p.state || run.state),
  );
  $("run-bar").style.width = p.total ? `${(100 * (p.done || 0)) / p.total}%` : "0";
  // One source for each number: this snapshot of /status. The rate here is the run's average since it started;
  // the throughput chart shows the rate of each interval.
  const items = [
    ["done / total", "count-done", p.total ? `${p.done || 0} / ${p.total}` : p.done || 0],
    ["in flight", "count-inflight", p.in_flight ?? "–"],
    ["failed", "count-failed", p.failed ?? 0],
    ["average rate /s", "count-rate", fmt(p.rate, 1), "trajectories per second since the run started"],
    ["mean reward (raw)", "count-reward", p.rewarded ? fmt(p.reward_sum / p.rewarded, 3) : "–",
     "mean raw reward of the run's trajectories that did not fail"],
    ["trajectories stored", "count-records", Object.values(s.records || {}).reduce((a, b) => a + b, 0)],
    ["groups ready", "count-ready", (s.groups || {}).ready || 0],
    ["groups delivered", "count-delivered", ((s.groups || {}).delivered || 0) + ((s.groups || {}).leased || 0)],
    ["groups filtered", "count-filtered", (s.groups || {}).filtered || 0],
    ["trainer version", "count-trainer", control.trainer_version ?? "–"],
    ["version lag", "count-lag", control.trainer_lead ?? "–"],
    ["admission", "count-admission", admission || "–"],
  ];
  // Groups earlier runs left undelivered: a fetch gets them only by naming their run (`run_id`).
  const earlier = Object.values(s.earlier_runs || {}).reduce((a, b) => a + b, 0);
  if (earlier) {
    const runs = Object.entries(s.earlier_runs).map(([id, n]) => `${id}: ${n}`).join("\n");
    items.push(["earlier runs' groups", "count-earlier", earlier, `not delivered by default; fetch with run_id\n${runs}`]);
  }
  for (const [label, id, value, title] of items) {
    counts.append(el("div", title ? { title } : {}, el("dt", {}, label), el("dd", { id }, value)));
  }
  // The runs table shows the current run's progress from the same snapshot.
  const row = document.querySelector(`#runs tr[data-run="${CSS.escape(run.run_id)}"] td.progress`);
  if (row) row.textContent = p.total ? `${p.done} / ${p.total}` : "–";
}

// A chart point of a snapshot, in the shape of the server's history samples (no run_id: no live run).
function pointOf(s) {
  const p = (s.run && s.run.progress) || {};
  return { t: s.t, run_id: p.run_id, done: p.done || 0, in_flight: p.in_flight || 0,
           lag: (s.control || {}).trainer_lead ?? null, reward_sum: p.reward_sum || 0, rewarded: p.rewarded || 0,
           engine: s.engine || {} };
}

function addPoint(point) {
  const h = state.history;
  // The server's history spans runs; a chart shows the current run only, so that an earlier run's spike
  // cannot set its scale: another run's point starts the series afresh.
  if (point.run_id !== state.chartRun) {
    for (const k of Object.keys(h)) h[k] = [];
    state.chartRun = point.run_id;
    state.lastPoint = null;
  }
  if (!point.run_id) return; // no live run: nothing to chart (the charts say "no data yet")
  const prev = state.lastPoint;
  const t = point.t;
  if (prev && t - prev.t > 0) h.throughput.push([t, Math.max(0, (point.done - prev.done) / (t - prev.t))]);
  // The mean raw reward of the trajectories that finished since the previous point.
  if (prev && point.rewarded > prev.rewarded) {
    h.reward.push([t, (point.reward_sum - prev.reward_sum) / (point.rewarded - prev.rewarded)]);
  }
  h.inflight.push([t, point.in_flight]);
  if (point.lag !== null && point.lag !== undefined) h.lag.push([t, point.lag]);
  if (prev) {
    let n = 0, sum = 0;
    for (const [endpoint, now] of Object.entries(point.engine)) {
      const before = prev.engine[endpoint] || { count: 0, sum: 0 };
      n += now.count - before.count;
      sum += now.sum - before.sum;
    }
    if (n > 0) h.latency.push([t, (1000 * sum) / n]);
  }
  state.lastPoint = point;
  for (const series of Object.values(h)) {
    while (series.length && (series.length > HISTORY || series[0][0] < t - WINDOW_S)) series.shift();
  }
}

function drawCharts() {
  for (const key of Object.keys(CHARTS)) lineChart(key, state.history[key]);
}

// The server's samples from before this page connected (one every few seconds, the last half hour).
function onHistory(points) {
  for (const k of Object.keys(state.history)) state.history[k] = [];
  state.chartRun = null;
  state.lastPoint = null;
  for (const point of points) addPoint(point);
  drawCharts();
}

// ---- charts --------------------------------------------------------------------------------------
// Drawn in CSS pixels (the viewBox is the box's own size) so text is never stretched; the plot area is inset
// and every label (ticks, unit) sits in the margins, never on the line.
const MARGIN = { left: 44, right: 16, top: 18, bottom: 20 };

function frame(svg, bottom = MARGIN.bottom) {
  const { width, height } = svg.getBoundingClientRect();
  const w = Math.round(width) || 240, h = Math.round(height) || 120;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  return { x0: MARGIN.left, x1: w - MARGIN.right, y0: h - bottom, y1: MARGIN.top, w, h };
}

function svgText(svg, x, y, s, cls, anchor = "middle") {
  const t = svgEl("text", { x, y, class: cls, "text-anchor": anchor });
  t.textContent = s;
  svg.append(t);
}

// Round ticks 1, 2 or 5 × 10^k apart, from at or below `lo` to at or above `hi` (whole numbers for counts).
function niceTicks(lo, hi, count, whole = false) {
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].map((m) => m * mag).find((x) => x >= raw * 0.999);
  if (whole) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let i = Math.floor(lo / step); i <= Math.ceil(hi / step); i++) ticks.push(+(i * step).toPrecision(12));
  return ticks;
}

// The plot area's frame, grid and tick labels; the y unit above the axis, the x unit (if any) below the ticks.
// Returns the value → pixel maps of the domains.
function axes(svg, f, { xDomain, xTicks, xText, yTicks, yUnit, xUnit }) {
  const [xa, xb] = xDomain, ya = yTicks[0], yb = yTicks[yTicks.length - 1];
  const sx = (v) => f.x0 + ((f.x1 - f.x0) * (v - xa)) / (xb - xa || 1);
  const sy = (v) => f.y0 - ((f.y0 - f.y1) * (v - ya)) / (yb - ya || 1);
  svg.append(svgEl("rect", { class: "plot", x: f.x0, y: f.y1, width: f.x1 - f.x0, height: f.y0 - f.y1 }));
  for (const v of yTicks) {
    svg.append(svgEl("line", { class: "grid", x1: f.x0, x2: f.x1, y1: sy(v), y2: sy(v) }));
    svgText(svg, f.x0 - 5, sy(v) + 3.5, String(v), "tick y", "end");
  }
  for (const v of xTicks) svgText(svg, sx(v), f.y0 + 13, xText(v), "tick x");
  svgText(svg, 2, 11, yUnit, "unit y", "start");
  if (xUnit) svgText(svg, (f.x0 + f.x1) / 2, f.h - 3, xUnit, "unit x");
  return { sx, sy };
}

function noData(svg, f, why) {
  // What would fill it, in the chart's box: a foreignObject lets the line wrap.
  const box = svgEl("foreignObject", { x: 8, y: 8, width: f.w - 16, height: f.h - 16 });
  box.append(el("div", { class: "empty", xmlns: "http://www.w3.org/1999/xhtml" }, why));
  svg.append(box);
}

// A series of [time, value] over the time before its newest point ("now"), in seconds or minutes.
function lineChart(key, points) {
  const { unit, digits, whole, zero = true, empty } = CHARTS[key];
  const svg = $(`chart-${key}`), f = frame(svg);
  if (!points.length) {
    $(`now-${key}`).textContent = "";
    return noData(svg, f, empty);
  }
  const now = points[points.length - 1][0], span = Math.max(now - points[0][0], 10);
  const step = [5, 10, 15, 30, 60, 120, 300, 600].find((x) => span / x <= 4) || 900;
  const xTicks = [];
  for (let k = Math.floor(span / step); k >= 0; k--) xTicks.push(-k * step);
  const xText = (v) => (v === 0 ? "now" : step >= 60 ? `−${-v / 60} min` : `−${-v} s`);
  const values = points.map((p) => p[1]);
  const max = Math.max(...values);
  const yTicks = niceTicks(zero ? Math.min(0, ...values) : Math.min(...values), max, 4, whole);
  const { sx, sy } = axes(svg, f, { xDomain: [-span, 0], xTicks, xText, yTicks, yUnit: unit });
  const xy = points.map(([t, v]) => [sx(t - now), sy(v)]);
  svg.append(svgEl("polyline", { points: xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ") }));
  const [lx, ly] = xy[xy.length - 1];
  svg.append(svgEl("circle", { cx: lx, cy: ly, r: 2.5 })); // the newest point, visible even alone
  // The values in words sit in the caption, beside the title: off the plot.
  $(`now-${key}`).textContent = `now ${fmt(values[values.length - 1], digits)} ${unit} · max ${fmt(max, digits)}`;
}

// ---- batches, reasons, runs, sessions -------------------------------------------------------------
async function refreshBatches() {
  try {
    const q = state.runId ? `?run_id=${encodeURIComponent(state.runId)}` : "";
    const { batches } = await getJSON(`/ui/api/batches${q}`);
    const box = $("batches");
    box.replaceChildren();
    if (!batches.length) return box.append("no batch delivered yet: the trainer fetches them with /get_rollout_data");
    const shown = batches.slice(0, MAX_BATCHES);  // the newest first
    const all = shown.flatMap((b) => b.raw);
    const lo = Math.min(...all, 0), hi = Math.max(...all, 1);
    for (const b of shown.slice().reverse()) batchHistogram(box, b, lo, hi);
  } catch (err) {
    failed(err);
  }
}

// One batch's raw rewards in 10 bins over the range shared by all batches shown (comparable side by side).
function batchHistogram(box, b, lo, hi) {
  const svg = svgEl("svg", { class: "histogram", role: "img", "aria-label": "raw rewards of the batch" });
  const mean = b.raw.length ? b.raw.reduce((a, c) => a + c, 0) / b.raw.length : null;
  box.append(el("figure", { class: "batch" },
    el("figcaption", {}, el("span", { class: "chart-title" }, `batch of ${when(b.created_at)}`)), svg,
    el("div", { class: "batch-label", title: b.batch_id },
      `${b.num_groups} groups · ${b.raw.length} trajectories · mean ${fmt(mean)}${b.acked ? "" : " · not acked"}`)));
  const xTicks = niceTicks(lo, hi, 2), a = xTicks[0], z = xTicks[xTicks.length - 1];
  const bins = new Array(10).fill(0);
  for (const r of b.raw) bins[Math.min(9, Math.floor(((r - a) / (z - a)) * 10))] += 1;
  const f = frame(svg, 32); // room below the ticks for the x unit
  const yTicks = niceTicks(0, Math.max(...bins, 1), 2, true);
  const { sx, sy } = axes(svg, f, {
    xDomain: [a, z], xTicks, xText: String, yTicks, yUnit: "trajectories", xUnit: "reward (raw)" });
  const w = (z - a) / 10, barWidth = Math.max(1, sx(a + w) - sx(a) - 2);
  bins.forEach((n, i) => n && svg.append(svgEl("rect", {
    class: "bar", x: sx(a + i * w) + 1, width: barWidth, y: sy(n), height: sy(0) - sy(n) })));
}

async function refreshReasons(s) {
  const body = $("reasons").tBodies[0];
  const rows = [];
  for (const [reason, n] of Object.entries(s.filtered || {})) rows.push(["filtered group", reason, n]);
  for (const [status, n] of Object.entries(s.records || {})) rows.push(["trajectory status", status, n]);
  // The run's records' own metrics (an environment's reward functions and metrics): their means.
  const metrics = (s.run && s.run.progress && s.run.progress.metrics) || {};
  for (const [name, m] of Object.entries(metrics)) rows.push(["metric (mean)", name, `${fmt(m.mean)} of ${m.n}`]);
  try {
    if (state.runId && (s.records || {}).failed) {
      const { failures } = await getJSON(`/ui/api/failures?run_id=${encodeURIComponent(state.runId)}`);
      for (const [kind, n] of Object.entries(failures)) rows.push(["failure", kind, n]);
    }
  } catch (err) {
    failed(err);
  }
  body.replaceChildren(...rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, c)))));
}

async function refreshRuns() {
  try {
    const { runs } = await getJSON("/ui/api/runs?limit=10");
    const live = state.last && state.last.run;
    $("runs").tBodies[0].replaceChildren(...runs.map((r) => {
      // The current run's progress is live in the snapshots; the store's copy is written now and then.
      const p = live && live.run_id === r.run_id ? live.progress || {} : r.progress || {};
      return el("tr", { class: r.run_id === state.runId ? "current" : null, dataset: { run: r.run_id } },
        el("td", {}, el("span", { class: "run-id", title: r.run_id }, r.run_id)),
        el("td", {}, r.task_type || "–"), el("td", {}, r.state),
        el("td", { class: "progress" }, p.total ? `${p.done} / ${p.total}` : "–"), el("td", {}, when(r.created_at)));
    }));
  } catch (err) {
    failed(err);
  }
}

async function refreshSessions() {
  try {
    const q = state.runId ? `?run_id=${encodeURIComponent(state.runId)}` : "";
    const { sessions } = await getJSON(`/sessions${q}`);
    const box = $("sessions");
    box.replaceChildren();
    if (!sessions.length) return box.append("none open");
    // The list counts branches; each session's own view has its tree (the first few sessions: a glance).
    const shown = sessions.slice(0, MAX_SESSIONS);
    const views = await Promise.all(shown.map((s) => getJSON(`/sessions/${encodeURIComponent(s.session_id)}`).catch(() => s)));
    for (const s of views) {
      box.append(el("div", {}, el("strong", {}, `session ${short(s.session_id, 12)}`), ` · ${s.instance_id} · ${s.kind} · ${s.state}`));
      if (Array.isArray(s.branches)) for (const b of s.branches) box.append(branchLine(b, s.branches));
    }
    if (sessions.length > shown.length) box.append(el("div", { class: "muted" }, `and ${sessions.length - shown.length} more`));
  } catch (err) {
    failed(err);
  }
}

function depth(branch, all, key = "branch") {
  let d = 0, cur = branch;
  while (cur && cur.parent_branch !== null && cur.parent_branch !== undefined && d < 50) {
    cur = all.find((x) => x[key] === cur.parent_branch);
    d += 1;
  }
  return d;
}

function branchLine(b, all) {
  const fork = b.parent_branch === null || b.parent_branch === undefined ? "root" : `forked from ${b.parent_branch} at turn ${b.fork_turn}`;
  return el("div", { class: "branch", style: `--depth:${depth(b, all)}` },
    `branch ${b.branch} · ${fork} · ${b.turns ?? b.branch_turns ?? "?"} turns${b.tokens ? ` · ${b.tokens} tokens` : ""}`);
}

// ---- inspector -----------------------------------------------------------------------------------
function searchQuery(before) {
  const form = new FormData($("search"));
  const q = new URLSearchParams();
  for (const name of ["uid", "instance_id", "status", "role", "reward_min", "reward_max"]) {
    const v = (form.get(name) || "").trim();
    if (v) q.set(name, v);
  }
  if (!form.get("all_runs") && state.runId) q.set("run_id", state.runId);
  if (before) q.set("before", before);
  q.set("limit", "50");
  return q;
}

async function search(before = null) {
  const seq = ++state.page.seq;
  try {
    const page = await getJSON(`/ui/api/trajectories?${searchQuery(before)}`);
    if (seq !== state.page.seq) return; // a later search was started meanwhile: its answer wins
    state.page.empty = !before && !page.items.length;
    if (!before) {
      state.page.newest = page.items.length ? page.items[0].rowid : (state.last && state.last.latest_rowid) || 0;
      $("newer").hidden = true;
    }
    state.page.next = page.next;
    $("older").disabled = page.next === null;
    $("results").tBodies[0].replaceChildren(...page.items.map((t) =>
      el("tr", { dataset: { uid: t.uid }, onclick: () => inspect(t.uid) },
        el("td", { class: "uid", title: t.uid }, t.uid), el("td", {}, t.instance_id), el("td", {}, t.epoch),
        el("td", {}, t.status), el("td", {}, fmt(t.reward)), el("td", {}, t.role || ""), el("td", {}, when(t.created_at)))));
    if (!page.items.length) $("results").tBodies[0].append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no trajectory matches")));
  } catch (err) {
    failed(err);
  }
}

async function inspect(uid) {
  for (const tr of $("results").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.uid === uid);
  try {
    const enc = encodeURIComponent(uid);
    const [detail, tokens] = await Promise.all([getJSON(`/ui/api/trajectories/${enc}`), getJSON(`/ui/api/trajectories/${enc}/tokens`)]);
    const rec = detail.record;
    const info = rec.extra_info || {};
    $("detail").hidden = false;
    $("detail-title").textContent = `${rec.uid} · ${rec.status} · reward ${fmt(rec.reward)}` +
      (rec.raw_reward !== null && rec.raw_reward !== undefined ? ` (raw ${fmt(rec.raw_reward)})` : "") +
      (info.weight_version_min !== undefined ? ` · weights ${info.weight_version_min}–${info.weight_version_max}` : "") +
      (detail.pruned_at ? ` · pruned ${when(detail.pruned_at)}` : "");
    renderMessages(rec.messages || []);
    renderGroup(detail.group, rec.uid);
    renderTokens(tokens);
    $("detail").scrollIntoView({ block: "start" }); // it opens below the list: bring it to the eye
  } catch (err) {
    failed(err);
  }
}

// Long texts (a system prompt listing two dozen tools runs to thousands of characters) start collapsed to
// their first lines, so the conversation stays readable; a click on them shows all.
const LONG_CHARS = 800, LONG_LINES = 12, PREVIEW_LINES = 3;

function textBlock(tag, cls, s) {
  const lines = s.split("\n");
  if (s.length <= LONG_CHARS && lines.length <= LONG_LINES) return el(tag, { class: cls }, s);
  return el("details", { class: "long" },
    el("summary", {}, el("span", { class: "preview" }, lines.slice(0, PREVIEW_LINES).join("\n").slice(0, 400) + " …"),
      el("span", { class: "more" }, `${lines.length} lines, ${s.length} characters`)),
    el(tag, { class: cls }, s));
}

function imageBlock(sha) {
  const img = el("img", { class: "msg-image", alt: `image ${sha.slice(0, 12)}`, title: `sha256 ${sha}` });
  // 404: retention deleted it with the records that held it (serve --prune-delivered-after-h)
  api(`/images/${sha}`).then((r) => (r.ok ? r.blob()
    : Promise.reject(new Error(r.status === 404 ? "no longer kept (retention)" : `${r.status}`))))
    .then((blob) => { img.src = URL.createObjectURL(blob); })
    .catch((err) => { img.replaceWith(el("div", { class: "muted" }, `image ${sha.slice(0, 12)}: ${err.message}`)); });
  return img;
}

function renderMessages(messages) {
  $("messages").replaceChildren(...messages.map((m) => {
    const parts = [el("span", { class: "role" }, m.role + (m.name ? ` (${m.name})` : ""))];
    if (m.reasoning_content) parts.push(textBlock("pre", "reasoning", m.reasoning_content));
    if (Array.isArray(m.content)) {
      // Content parts: text, and images named by their hash, shown in place (fetched with the token, as every read)
      for (const p of m.content) {
        if (p && p.type === "image" && String(p.image || "").startsWith("sha256:")) parts.push(imageBlock(p.image.slice(7)));
        else if (p && p.type === "text") parts.push(textBlock("div", "content", p.text || ""));
        else parts.push(textBlock("div", "content", JSON.stringify(p, null, 1)));
      }
    } else if (m.content) parts.push(textBlock("div", "content", String(m.content)));
    if (m.tool_calls) parts.push(textBlock("pre", "tool-calls", JSON.stringify(m.tool_calls, null, 1)));
    return el("div", { class: `msg role-${String(m.role).replace(/[^a-z_]/gi, "")}` }, parts);
  }));
}

function renderGroup(group, uid) {
  const members = group.members || [];
  const sessions = members.some((m) => m.session_id);
  const head = ["uid", "status", "raw reward", "normalized", ...(sessions ? ["branch", "parent", "fork turn"] : [])];
  const table = el("table", { id: "group-table" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, members.map((m) => el("tr", { class: m.uid === uid ? "current" : null },
      el("td", { class: "uid" }, short(m.uid, 40)), el("td", {}, m.status), el("td", {}, fmt(m.raw_reward)),
      el("td", {}, m.normalized ? fmt(m.reward) : "–"),
      sessions ? [el("td", {}, m.branch ?? ""), el("td", {}, m.parent_branch ?? "root"), el("td", {}, m.fork_turn ?? "")] : []))));
  $("group").replaceChildren(
    el("div", { class: "muted" }, `${group.instance_id} · epoch ${group.epoch}${group.part ? ` · part ${group.part}` : ""} · ${group.state || "?"}${group.reason ? ` (${group.reason})` : ""}`),
    table,
    sessions ? el("div", {}, el("h4", {}, "session branches"), members.filter((m) => m.session_id).map((m) => branchLine(m, members))) : "",
  );
}

function renderTokens(view) {
  const box = $("tokens");
  box.replaceChildren();
  if (!view.tokens) {
    $("token-note").textContent = view.reason;
    return;
  }
  const mismatchAt = view.mismatch ? view.mismatch.token_index : null;
  $("token-note").textContent = `${view.tokens.length} tokens, prompt ${view.prompt_length}, ${view.turn_starts.length} model turns` +
    (view.mismatch ? ` · tokenization check (${view.mismatch.mode}): sequence and template differ at token ${mismatchAt}` : "");
  const turns = new Map(view.turn_starts.map((pos, k) => [pos, k + 1]));
  const frag = document.createDocumentFragment();
  let version = null;
  for (let i = 0; i < view.tokens.length; i++) {
    const v = view.version[i];
    if (v !== null && v !== version) {
      frag.append(el("span", { class: "version-mark" }, `weights ${v}`));
      version = v;
    }
    if (turns.has(i)) frag.append(el("span", { class: "turn-mark" }, `turn ${turns.get(i)}`));
    const loss = view.loss[i];
    const cls = ["tok", loss === 1 ? "l1" : loss === 0 ? "l0" : "lnone"];
    if (i === mismatchAt) cls.push("mismatch");
    const lp = view.logprob[i];
    const title = `#${i} id ${view.tokens[i]} · loss ${loss ?? "–"} · log-prob ${lp === null ? "–" : lp.toFixed(4)}` +
      (v !== null ? ` · weights ${v}` : "") + (i === mismatchAt ? " · tokenization mismatch starts here" : "");
    frag.append(el("span", { class: cls.join(" "), title, dataset: { i: String(i), loss: String(loss), logprob: lp === null ? "" : String(lp) } }, view.text[i]));
  }
  box.append(frag);
}

// ---- wiring --------------------------------------------------------------------------------------
function connect() {
  showError("");
  setConn("off", "connecting");
  state.runId = null;
  state.last = null;
  runStream();
}

document.addEventListener("DOMContentLoaded", () => {
  $("token").value = state.token;
  $("auth").addEventListener("submit", (e) => {
    e.preventDefault();
    state.token = $("token").value.trim();
    sessionStorage.setItem(TOKEN_KEY, state.token);
    connect();
  });
  $("search").addEventListener("submit", (e) => {
    e.preventDefault();
    search();
  });
  $("older").addEventListener("click", () => state.page.next && search(state.page.next));
  $("first-page").addEventListener("click", () => search());
  $("show-newer").addEventListener("click", () => search());
  drawCharts(); // empty until the stream's history: "no data yet" rather than blank boxes
  connect();
});
