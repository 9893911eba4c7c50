// The dashboard: reads /nodes, /runs, /runs/{id} and its table, and follows /events to stay live.
// Everything the server sends reaches the page through textContent, never as markup.
"use strict";

const TOKEN_KEY = "rlx-cluster-token";
const RECENT_RUNS = 15;
const RETRY_MS = [500, 1000, 2000, 5000, 10000];
// Events kept while a running run's record is fetched, replayed once it arrives.
const BACKLOG = 4096;
const RENDER_MS = 100;
const TABLE_MS = 1000;

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  following: false,
  lastEventId: null,
  backlog: [],
  shown: null, // the run in the run panel (see fromRecord)
};

class Unauthorized extends Error {}

const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function authHeaders(extra = {}) {
  return state.token ? { ...extra, Authorization: `Bearer ${state.token}` } : extra;
}

async function api(path, asText = false) {
  const response = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (response.status === 401) throw new Unauthorized();
  if (!response.ok) {
    const body = await response.text();
    let why = body;
    try { why = JSON.parse(body).error || body; } catch { /* not JSON: say it as it came */ }
    throw new Error(`${path}: ${response.status} ${why}`);
  }
  return asText ? response.text() : response.json();
}

function throttled(fn, ms) {
  let timer = null;
  return () => {
    if (timer === null) timer = setTimeout(() => { timer = null; guarded(fn); }, ms);
  };
}

// Runs `fn`, turning a 401 into the token form and any other failure into the problem line.
async function guarded(fn) {
  try {
    await fn();
  } catch (err) {
    if (err instanceof Unauthorized) askToken(state.token ? "That token was refused." : "");
    else showProblem(String(err.message || err));
  }
}

function showProblem(text) {
  $("problem").textContent = text;
  $("problem").hidden = !text;
}

function setConn(text) {
  $("conn").textContent = text;
  $("conn").dataset.state = text;
}

// ---- formatting

function fmtMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(1)} ms`;
}

function fmtBytes(bytes) {
  if (bytes >= 1e9) return `${(bytes / 1e9).toFixed(2)} GB`;
  return `${(bytes / 1e6).toFixed(1)} MB`;
}

function pill(text, title = "") {
  return el("span", { className: "pill", textContent: text, title });
}

function withState(node, value) {
  node.dataset.state = value;
  return node;
}

// ---- nodes

async function loadNodes() {
  const { nodes } = await api("/nodes");
  $("nodes").tBodies[0].replaceChildren(...nodes.map(nodeRow));
}

function nodeRow(n) {
  const layers = n.layers ? `${n.layers.start}–${n.layers.end}` : "";
  const status = el("td", {}, withState(pill(n.state, n.error || ""), n.state));
  return el("tr", {},
    el("td", { textContent: n.stage }),
    el("td", { className: "addr", textContent: n.addr || "—" }),
    el("td", { textContent: layers }),
    status,
    el("td", { textContent: [n.device, n.precision].filter(Boolean).join(" ") }),
    el("td", { className: "num", textContent: n.resident_bytes == null ? "—" : fmtBytes(n.resident_bytes) }),
    el("td", { className: "num", textContent: n.build_ms == null ? "—" : fmtMs(n.build_ms) }),
    el("td", { className: "num", textContent: n.restarts ?? 0 }),
  );
}

// ---- recent runs

async function loadRuns() {
  const { runs } = await api(`/runs?limit=${RECENT_RUNS}`);
  $("runs").tBodies[0].replaceChildren(...runs.map(runRow));
  return runs;
}

function totalMs(run) {
  return run.total_forward_ms + (run.decode ? run.decode.total_forward_ms : 0);
}

// A run that outlived a stage's death: a mark beside its status, the stages and waits in its title.
function recoveredMark(run) {
  const recoveries = run.recoveries || [];
  if (!recoveries.length) return "";
  const told = recoveries.map((r) => `stage ${r.stage} ${r.addr} → ${r.new_addr}: waited ${fmtMs(r.waited_ms)}, ` +
    `replayed ${r.replayed_positions} positions in ${fmtMs(r.replay_ms)}`).join("\n");
  return el("span", { className: "recovered", textContent: ` recovered ×${recoveries.length}`, title: told });
}

function runRow(run) {
  const trace = el("a", { href: `/runs/${run.id}/trace`, textContent: "trace", download: `run-${run.id}-trace.json` });
  trace.addEventListener("click", (e) => downloadTrace(e, trace));
  const tps = run.decode ? run.decode.tokens_per_s : run.tokens_per_s;
  const prompt = run.prompt ?? `seq ${run.seq}`;
  const row = el("tr", { className: state.shown && state.shown.id === run.id ? "selected" : "" },
    el("td", {}, el("button", { type: "button", textContent: `#${run.id}` })),
    el("td", {}, withState(pill(run.status, run.error || ""), run.status), recoveredMark(run)),
    el("td", { className: "prompt", textContent: prompt, title: prompt }),
    el("td", { className: "num", textContent: run.prompt == null ? "—" : run.tokens.length }),
    el("td", { className: "num", textContent: fmtMs(totalMs(run)) }),
    el("td", { className: "num", textContent: tps.toFixed(1) }),
    el("td", {}, trace),
  );
  row.dataset.run = run.id;
  row.addEventListener("click", (e) => { if (e.target !== trace) guarded(() => select(run.id)); });
  return row;
}

// A plain link cannot carry the bearer token: with one set, fetch the trace and hand it over as a file.
async function downloadTrace(event, link) {
  if (!state.token) return;
  event.preventDefault();
  await guarded(async () => {
    const response = await fetch(link.href, { headers: authHeaders() });
    if (response.status === 401) throw new Unauthorized();
    if (!response.ok) throw new Error(`${link.pathname}: ${response.status}`);
    const url = URL.createObjectURL(await response.blob());
    el("a", { href: url, download: link.download }).click();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  });
}

// ---- the run panel

// A run as the panel shows it: per stage, forward and compute summed over every forward of the run.
function fromRecord(run) {
  const stages = new Map();
  const add = (t) => addStage(stages, t.stage, t.addr, t.forward_ms, t.compute_ms);
  run.timings.forEach(add);
  if (run.decode) run.decode.timings.forEach(add);
  return {
    id: run.id, status: run.status, model: run.model, prompt: run.prompt, seq: run.seq,
    text: run.text || "", generated: run.tokens.length, error: run.error, stages,
    totalMs: totalMs(run), tokensPerS: run.decode ? run.decode.tokens_per_s : run.tokens_per_s,
    // While running: events of later steps and tokens than the record holds are added to it.
    fromStep: run.tokens.length + 1, fromToken: run.tokens.length,
  };
}

function addStage(stages, stage, addr, forward, compute) {
  const s = stages.get(stage) || { stage, addr, forward: 0, compute: 0 };
  s.forward += forward;
  s.compute += compute;
  stages.set(stage, s);
}

async function select(id) {
  const run = await api(`/runs/${id}`);
  show(fromRecord(run));
  if (run.status === "running") replayBacklog(id);
  await loadTable();
}

function show(view) {
  state.shown = view;
  for (const row of $("runs").tBodies[0].rows) row.classList.toggle("selected", Number(row.dataset.run) === view.id);
  renderRun();
}

function renderRun() {
  const v = state.shown;
  if (!v) return;
  $("run-title").textContent = `Run ${v.id}`;
  withState($("run-status"), v.status).textContent = v.status;
  const running = v.status === "running" || v.status === "queued";
  const meta = [v.model, v.prompt ? `${v.seq} prompt tokens` : `seq ${v.seq}`];
  if (v.prompt) meta.push(`${v.generated} generated`);
  if (!running) meta.push(`forward ${fmtMs(v.totalMs)}`, `${v.tokensPerS.toFixed(1)} tokens/s`);
  $("run-meta").textContent = meta.filter(Boolean).join(" · ");
  $("run-error").textContent = v.error || "";
  $("prompt").textContent = v.prompt || "(synthetic input: no text)";
  $("generated").textContent = v.text;
  renderStages([...v.stages.values()].sort((a, b) => a.stage - b.stage));
}

function renderStages(stages) {
  const longest = Math.max(1e-9, ...stages.map((s) => s.forward));
  $("stages").replaceChildren(...stages.map((s) => {
    const network = Math.max(0, s.forward - s.compute);
    const width = (ms) => `${(100 * ms / longest).toFixed(2)}%`;
    const bar = el("div", { className: "bar" },
      el("span", { className: "compute", title: `compute ${fmtMs(s.compute)}` }),
      el("span", { className: "network", title: `network ${fmtMs(network)}` }));
    bar.children[0].style.width = width(Math.min(s.compute, s.forward));
    bar.children[1].style.width = width(network);
    const row = el("div", { className: "stage" },
      el("span", { className: "who", textContent: `stage ${s.stage} · ${s.addr}`, title: s.addr }),
      bar,
      el("span", { className: "ms",
        textContent: `forward ${fmtMs(s.forward)} = compute ${fmtMs(s.compute)} + network ${fmtMs(network)}` }));
    row.dataset.stage = s.stage;
    return row;
  }));
}

async function loadTable() {
  const id = state.shown && state.shown.id;
  if (id == null) return;
  const text = await api(`/runs/${id}/table`, true);
  if (state.shown && state.shown.id === id) $("table").textContent = text;
}

const renderSoon = throttled(renderRun, RENDER_MS);
const tableSoon = throttled(loadTable, TABLE_MS);
const runsSoon = throttled(loadRuns, RENDER_MS);
const nodesSoon = throttled(loadNodes, RENDER_MS);

// ---- live events

function startLive(id) {
  show({ id, status: "running", model: "", prompt: null, seq: 0, text: "", generated: 0, error: null,
    stages: new Map(), totalMs: 0, tokensPerS: 0, fromStep: 0, fromToken: 0 });
  $("table").textContent = "";
  // Only what the run was asked to do: its progress comes from the events that follow.
  guarded(async () => {
    const run = await api(`/runs/${id}`);
    const v = state.shown;
    if (v && v.id === id) Object.assign(v, { model: run.model, prompt: run.prompt, seq: run.seq });
    renderSoon();
  });
}

function applyProgress(ev) {
  const v = state.shown;
  if (!v || v.id !== ev.run || v.status !== "running") return;
  if (ev.kind === "stage_forward" && ev.step >= v.fromStep) {
    addStage(v.stages, ev.stage, ev.addr, ev.forward_ms, ev.compute_ms);
  } else if (ev.kind === "token" && ev.index >= v.fromToken) {
    v.text += ev.text;
    v.generated = ev.index + 1;
    v.fromToken = ev.index + 1;
  } else {
    return;
  }
  renderSoon();
  tableSoon();
}

function replayBacklog(id) {
  for (const ev of state.backlog) if (ev.run === id) applyProgress(ev);
}

function onEvent(kind, ev) {
  switch (kind) {
    case "stage_forward":
    case "token":
      state.backlog.push(ev);
      if (state.backlog.length > BACKLOG) state.backlog.splice(0, state.backlog.length - BACKLOG);
      applyProgress(ev);
      break;
    case "run_queued":
      runsSoon();
      break;
    case "run_started":
      state.backlog = [];
      startLive(ev.run);
      runsSoon();
      break;
    case "run_finished":
      runsSoon();
      if (state.shown && state.shown.id === ev.run) guarded(() => select(ev.run));
      break;
    case "node":
      nodesSoon();
      break;
    case "lagged": // events were missed: read everything afresh
      guarded(refreshAll);
      break;
  }
}

// EventSource cannot send a header, so the stream is read with fetch and parsed here.
async function readStream(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { kind: "message", data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (line === "") {
        if (event.id !== null) state.lastEventId = event.id;
        if (event.data.length) onEvent(event.kind, JSON.parse(event.data.join("\n")));
        event = { kind: "message", data: [], id: null };
        continue;
      }
      if (line.startsWith(":")) continue; // a keep-alive comment
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") event.kind = text;
      else if (field === "data") event.data.push(text);
      else if (field === "id") event.id = text;
    }
  }
}

async function follow() {
  if (state.following) return;
  state.following = true;
  let attempt = 0;
  while (state.following) {
    try {
      const headers = authHeaders({ Accept: "text/event-stream" });
      if (state.lastEventId !== null) headers["Last-Event-ID"] = state.lastEventId;
      const response = await fetch("/events", { headers, cache: "no-store" });
      if (response.status === 401) throw new Unauthorized();
      if (!response.ok && state.lastEventId !== null) {
        // Too far behind to resume: start afresh from what the API says now.
        state.lastEventId = null;
        await refreshAll();
        continue;
      }
      if (!response.ok) throw new Error(`/events: ${response.status}`);
      setConn("live");
      attempt = 0;
      await readStream(response.body);
    } catch (err) {
      if (err instanceof Unauthorized) {
        state.following = false;
        askToken(state.token ? "That token was refused." : "");
        return;
      }
    }
    setConn("offline");
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS[Math.min(attempt++, RETRY_MS.length - 1)]));
    await guarded(refreshAll);
  }
}

// ---- start, and the token form

async function refreshAll() {
  const [, runs] = await Promise.all([loadNodes(), loadRuns()]);
  showProblem("");
  const keep = state.shown && runs.some((r) => r.id === state.shown.id) ? state.shown.id : null;
  const id = keep ?? (runs.length ? runs[0].id : null);
  if (id !== null) await select(id);
}

function askToken(message) {
  setConn("locked");
  $("auth").hidden = false;
  $("auth-error").textContent = message;
  $("token").focus();
}

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, state.token);
  $("auth").hidden = true;
  start();
});

async function start() {
  let ok = false;
  await guarded(async () => { await refreshAll(); ok = true; });
  if (ok) follow();
}

start();
