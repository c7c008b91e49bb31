// Muster dashboard: hash-routed pages over /api/*, live through one EventSource.
// Pages refetch only what they show (one page of jobs, one job) when an event touches it.
"use strict";

const main = document.getElementById("main");
const liveBadge = document.getElementById("live");
let page = null; // {onEvent(ev), onOverflow()}
let generation = 0; // bumped on every route change: a late load of an old page draws nothing

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

async function getJSON(url) {
  const resp = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await resp.json().catch(() => ({ error: resp.statusText }));
  if (!resp.ok) throw new Error(body.error || resp.statusText);
  return body;
}

function debounce(fn, ms) {
  let timer = null;
  const born = generation;
  return () => {
    if (!timer) timer = setTimeout(() => { timer = null; if (born === generation) fn(); }, ms);
  };
}

const fmt = {
  gpuh: (s) => (s / 3600).toFixed(2),
  money: (x) => "$" + (x || 0).toFixed(2),
  pct: (x) => (100 * (x || 0)).toFixed(0) + "%",
  ago: (ts, now) => (ts ? dur(now - ts) + " ago" : "-"),
  time: (ts) => (ts ? new Date(ts * 1000).toLocaleTimeString() : "-"),
};
function dur(s) {
  if (s === null || s === undefined) return "-";
  if (s < 60) return s.toFixed(1) + "s";
  if (s < 3600) return (s / 60).toFixed(1) + "m";
  return (s / 3600).toFixed(1) + "h";
}
// A number cell never blank: a missing value (an omitted default) is 0.
const num = (x, digits) => (digits === undefined ? String(x || 0) : (x || 0).toFixed(digits));
const stateCell = (s) => h("td", { class: "state-" + s, "data-col": "state" }, s);
function table(headers, rows, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { class: x.num ? "num" : null }, x.t || x)))),
    h("tbody", {}, rows));
}
function show(title, ...content) {
  main.replaceChildren(h("h2", {}, title), ...content.filter((c) => c !== null && c !== undefined));
}
function fail(err) {
  main.append(h("p", { class: "error" }, String(err.message || err)));
}
// Each page draws through these: once the user has moved on, a late answer draws nothing.
function guarded(fn) {
  const born = generation;
  return (...args) => { if (born === generation) fn(...args); };
}

// ---------------------------------------------------------------- pages
function fleetPage() {
  const show = guarded(window.show), fail = guarded(window.fail);
  const load = async () => {
    const d = await getJSON("/api/fleet");
    const rows = [];
    let free = 0;
    for (const c of d.clusters) {
      // Stale watches: the agent cannot see its cluster, so nothing is placed there.
      const health = c.stale_s > 0
        ? h("td", { class: "health-stale", title: "Kubernetes watches failing; no placements" },
          c.health + ", stale watches " + Math.round(c.stale_s) + "s")
        : h("td", { class: "health-" + c.health }, c.health);
      for (const f of c.flavors && c.flavors.length ? c.flavors : [null]) {
        free += f ? f.gpu_free || 0 : 0;
        rows.push(h("tr", { "data-cluster": c.name },
          h("td", {}, c.name), health.cloneNode(true),
          h("td", {}, f ? f.name : "-"), h("td", {}, f ? f.capacity_type : ""),
          h("td", {}, f ? f.gpu_type : ""),
          h("td", { class: "num" }, num(f && f.gpu_total)), h("td", { class: "num" }, num(f && f.gpu_used)),
          h("td", { class: "num" }, num(f && f.gpu_free)),
          h("td", { class: "num" }, num(f && f.interruptions)),
          h("td", { class: "num" }, f ? num(f.interruption_rate_per_node_hour, 3) + " vs " +
            num(f.prior_rate_per_node_hour, 3) : "-"),
          h("td", { class: "num" }, num(c.running_jobs)), h("td", {}, fmt.ago(c.last_heartbeat, d.now))));
      }
    }
    show("Fleet",
      h("div", { class: "cards" },
        h("div", { class: "card" }, h("b", {}, d.clusters.length), "clusters"),
        h("div", { class: "card" }, h("b", {}, d.gpu_total), "GPUs"),
        h("div", { class: "card" }, h("b", { "data-testid": "free-gpus" }, free), "free GPUs"),
        h("div", { class: "card" }, h("b", {}, fmt.pct(d.spot_share)), "spot share")),
      table(["cluster", "health", "flavor", "capacity", "GPU type", { t: "GPUs", num: 1 },
        { t: "used", num: 1 }, { t: "free", num: 1 }, { t: "notices", num: 1 },
        { t: "rate/node-h vs prior", num: 1 }, { t: "jobs", num: 1 }, "heartbeat"], rows,
        { "data-testid": "fleet" }));
  };
  const refresh = debounce(() => load().catch(fail), 1000);
  load().catch(fail);
  return { onEvent: refresh, onOverflow: refresh };
}

function queuesPage() {
  const show = guarded(window.show), fail = guarded(window.fail);
  const load = async () => {
    const d = await getJSON("/api/queues");
    const rows = [];
    for (const q of d.queues) {
      const flavors = q.flavors && q.flavors.length ? q.flavors : [{ flavor: "-", resources: [] }];
      for (const f of flavors) {
        const gpu = (f.resources || []).find((r) => r.resource === "gpu") || {};
        const nominal = gpu.nominal === undefined || gpu.nominal === null ? null : gpu.nominal;
        const use = nominal ? Math.min(1, (gpu.used || 0) / nominal) : 0;
        rows.push(h("tr", { "data-queue": q.name },
          h("td", {}, q.name), h("td", {}, q.cohort || "-"),
          h("td", { "data-col": "flavor", title: f.is_class === false
            ? "no flavor class of the config matches this cluster flavor: its own name counts" : null },
            f.is_class === false ? f.flavor + " (cluster flavor)" : f.flavor),
          h("td", { class: "num" }, gpu.used || 0), h("td", { class: "num" }, nominal === null ? "∞" : nominal),
          h("td", {}, h("div", { class: "bar" }, h("span", { style: `width:${(use * 100).toFixed(0)}%` }))),
          h("td", { class: "num" }, gpu.borrowed || 0), h("td", { class: "num" }, gpu.lent || 0),
          h("td", { class: "num" }, (q.dominant_share || 0).toFixed(3)),
          h("td", { class: "num", "data-col": "pending" }, q.pending || 0),
          h("td", { class: "num" }, q.admitted || 0), h("td", { class: "num" }, dur(q.oldest_wait_s))));
      }
    }
    show("Queues", table(["queue", "cohort", "flavor class", { t: "GPUs used", num: 1 },
      { t: "nominal", num: 1 }, "use", { t: "borrowed", num: 1 }, { t: "lent", num: 1 },
      { t: "DRF share", num: 1 }, { t: "pending", num: 1 }, { t: "admitted", num: 1 },
      { t: "oldest wait", num: 1 }], rows, { "data-testid": "queues" }));
  };
  const refresh = debounce(() => load().catch(fail), 1000);
  load().catch(fail);
  return { onEvent: refresh, onOverflow: refresh };
}

function jobsPage(query) {
  const show = guarded(window.show), fail = guarded(window.fail);
  const params = new URLSearchParams(query);
  const limit = 50;
  const offset = Number(params.get("offset") || 0);
  let shown = new Set();
  const body = h("tbody", {});
  const info = h("span", { class: "muted" });
  const field = (name, ph) => h("input", { name, placeholder: ph, value: params.get(name) || "" });
  const stateSel = h("select", { name: "state" }, h("option", { value: "" }, "any state"),
    ["queued", "admitted", "running", "preempting", "succeeded", "failed", "cancelled"].map(
      (s) => h("option", { value: s, selected: params.get("state") === s ? "" : null }, s)));
  const form = h("form", { class: "filters", onsubmit: (e) => {
    e.preventDefault();
    const p = new URLSearchParams();
    for (const el of form.elements) if (el.name && el.value) p.set(el.name, el.value);
    location.hash = "#/jobs?" + p.toString();
  } }, field("queue", "queue"), stateSel, field("cluster", "cluster"), field("name", "name contains"),
    h("button", { type: "submit" }, "Filter"));
  const go = (o) => { params.set("offset", String(Math.max(0, o))); location.hash = "#/jobs?" + params; };
  const pager = h("div", { class: "pager" },
    h("button", { onclick: () => go(offset - limit), disabled: offset === 0 ? "" : null }, "‹ newer"),
    info, h("button", { id: "older", onclick: () => go(offset + limit) }, "older ›"));
  const load = async () => {
    const q = new URLSearchParams(params); q.set("limit", String(limit));
    const d = await getJSON("/api/jobs?" + q);
    shown = new Set(d.jobs.map((j) => j.job_id));
    body.replaceChildren(...d.jobs.map((j) => h("tr", { "data-job": j.job_id },
      h("td", {}, h("a", { href: "#/job/" + encodeURIComponent(j.job_id) }, j.job_id)),
      h("td", {}, j.name), h("td", {}, j.queue), stateCell(j.state),
      h("td", { "data-col": "cluster", class: j.cluster ? null : "muted",
        title: !j.cluster && j.where ? "where its last attempt ran" : null }, j.where || "-"),
      h("td", { class: "num" }, j.gpus), h("td", { class: "num", "data-col": "attempt" }, j.attempt),
      h("td", { class: "muted" }, j.state === "queued" ? j.reason || "" : ""))));
    info.textContent = `${d.total ? d.offset + 1 : 0}–${d.offset + d.jobs.length} of ${d.total}`;
    document.getElementById("older").disabled = d.offset + d.jobs.length >= d.total;
  };
  const reload = debounce(() => load().catch(fail), 500);
  show("Jobs", form, pager, h("table", { "data-testid": "jobs" },
    h("thead", {}, h("tr", {}, ["job", "name", "queue", "state", "where", "GPUs", "attempt", "reason"].map(
      (x) => h("th", {}, x)))), body));
  load().catch(fail);
  return {
    // Only the visible page is refetched: when one of its jobs changed, or a new job may
    // belong on the first page.
    onEvent: (ev) => { if (shown.has(ev.job_id) || (ev.kind === "queued" && offset === 0)) reload(); },
    onOverflow: reload,
  };
}

function timeline(job, now) {
  job = { ...job, attempts: job.attempts || [] };
  const start = job.submitted_at;
  const end = Math.max(now, ...job.attempts.map((a) => a.ended_at || now));
  const W = 900, rowH = 26, H = 40 + rowH * (job.attempts.length + 1);
  const x = (t) => 110 + ((t - start) / Math.max(end - start, 1e-3)) * (W - 130);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("class", "timeline");
  svg.setAttribute("data-testid", "timeline");
  const add = (tag, attrs, text) => {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text !== undefined) el.textContent = text;
    svg.append(el);
  };
  const first = job.attempts.length ? job.attempts[0].dispatched_at : now;
  add("text", { x: 4, y: 28 }, "queued");
  add("rect", { x: x(start), y: 16, width: Math.max(2, x(first) - x(start)), height: 16, fill: "#f59e0b" });
  job.attempts.forEach((a, i) => {
    const y = 16 + rowH * (i + 1);
    const running = a.running_at || a.ended_at || now;
    const stop = a.ended_at || now;
    add("text", { x: 4, y: y + 12 }, `#${a.attempt} ${a.cluster}`);
    add("rect", { x: x(a.dispatched_at), y, width: Math.max(2, x(running) - x(a.dispatched_at)), height: 16, fill: "#60a5fa" });
    if (a.running_at) add("rect", { x: x(running), y, width: Math.max(2, x(stop) - x(running)), height: 16, fill: "#16a34a" });
    const label = (a.resume_from_step !== undefined ? `resumed from step ${a.resume_from_step} · ` : "") +
      (a.end_cause ? a.end_cause : a.ended_at ? "ended" : a.running_at ? "running" : "admitted");
    // After the bar when it fits, else before the bar's start, else inside the bar's end.
    const width = 6.5 * label.length;
    let at = { x: x(stop) + 4, "text-anchor": "start" };
    if (x(stop) + 4 + width > W) {
      at = x(a.dispatched_at) - 4 - width > 110
        ? { x: x(a.dispatched_at) - 4, "text-anchor": "end" }
        : { x: x(stop) - 4, "text-anchor": "end", class: "inside" };
    }
    add("text", { ...at, y: y + 12, "data-attempt": a.attempt }, label);
  });
  add("text", { x: 110, y: H - 4 }, fmt.time(start));
  add("text", { x: W - 90, y: H - 4 }, fmt.time(end));
  return svg;
}

function jobPage(jobId) {
  const show = guarded(window.show), fail = guarded(window.fail);
  const load = async () => {
    let d;
    try { d = await getJSON("/api/jobs/" + encodeURIComponent(jobId)); } catch (e) {
      show("Job " + jobId, h("p", { class: "error", "data-testid": "job-error" }, e.message)); return;
    }
    const j = d.job, a = j.accounting || {};
    j.attempts = j.attempts || []; // a job never admitted has none
    const ck = j.latest_checkpoint;
    show("Job " + j.job_id,
      h("div", { class: "cards", "data-testid": "job-summary" },
        h("div", { class: "card" }, h("b", { class: "state-" + j.state, "data-testid": "job-state" }, j.state), "state"),
        h("div", { class: "card" }, h("b", { "data-testid": "job-cluster" }, j.cluster || j.where || "-"),
          j.cluster || !j.where ? "cluster" : "cluster (last attempt)"),
        h("div", { class: "card" }, h("b", { "data-testid": "job-attempt" }, j.attempt), "attempt"),
        h("div", { class: "card" }, h("b", {}, fmt.gpuh(a.gpu_seconds_used || 0)), "GPU-hours used"),
        h("div", { class: "card" }, h("b", {}, fmt.gpuh(a.gpu_seconds_lost || 0)), "GPU-hours lost"),
        h("div", { class: "card" }, h("b", {}, fmt.money(a.cost)), "cost"),
        h("div", { class: "card" }, h("b", {}, ck ? "step " + ck.step : "-"), "latest checkpoint")),
      j.reason ? h("p", { class: "muted", "data-testid": "job-reason" }, "last change: " + j.reason) : null,
      j.size ? h("p", { "data-testid": "job-size" }, "elastic: " + j.size) : null,
      timeline(j, d.now),
      d.why ? h("div", {}, h("h3", {}, "Why pending"), h("ul", { "data-testid": "why" },
        (d.why.reasons || []).map((r) => h("li", {}, `${r.code}: ${r.message}`)))) : null,
      table(["attempt", "cluster", "flavor", "capacity", "dispatched", "running", "ended", "cause",
        "resumed from", { t: "GPU-h", num: 1 }, { t: "lost", num: 1 }, { t: "cost", num: 1 }],
        j.attempts.map((x) => h("tr", { "data-attempt": x.attempt },
          h("td", {}, x.attempt), h("td", {}, x.cluster), h("td", {}, x.flavor), h("td", {}, x.capacity_type),
          h("td", {}, fmt.time(x.dispatched_at)), h("td", {}, fmt.time(x.running_at)),
          h("td", {}, fmt.time(x.ended_at)), h("td", {}, x.end_cause || ""),
          h("td", {}, x.resume_from_step ?? ""), h("td", { class: "num" }, fmt.gpuh(x.gpu_seconds)),
          h("td", { class: "num" }, fmt.gpuh(x.gpu_seconds_lost)), h("td", { class: "num" }, fmt.money(x.cost)))),
        { "data-testid": "attempts" }),
      h("h3", {}, "Last log lines"),
      logs);
    if (j.attempt) loadLogs();
  };
  const logs = h("pre", { class: "logs", "data-testid": "logs" }, "no attempt yet");
  const loadLogs = async () => {
    const d = await getJSON("/api/jobs/" + encodeURIComponent(jobId) + "/logs?tail=20");
    logs.textContent = d.lines.length ? d.lines.join("\n") : d.error || "(no output yet)";
  };
  const reload = debounce(() => load().catch(fail), 300);
  load().catch(fail);
  return { onEvent: (ev) => { if (ev.job_id === jobId) reload(); }, onOverflow: reload };
}

function interruptionsPage() {
  const show = guarded(window.show), fail = guarded(window.fail);
  const load = async () => {
    const d = await getJSON("/api/interruptions");
    const fleetNotices = d.fleet_notices === null || d.fleet_notices === undefined ? "?" : d.fleet_notices;
    const summary = h("p", { class: "muted", "data-testid": "interruptions-summary" },
      `${d.total} interruption${d.total === 1 ? "" : "s"} of a job since the dashboard started ` +
      `(the newest ${d.items.length} listed); ${fleetNotices} spot notices on the fleet's ` +
      "nodes in all, most on nodes running no job");
    const moved = (s) => (s === null || s === undefined ? "-" : s < 0.05 ? "at once" : dur(s));
    show("Interruptions", summary, table(["notice", "job", "attempt", "cause", "from", "to", "resumed from",
      { t: "placed again after", num: 1 }, { t: "running again after", num: 1 }],
      d.items.map((i) => h("tr", { "data-job": i.job_id },
        h("td", {}, fmt.time(i.notice_at)),
        h("td", {}, h("a", { href: "#/job/" + encodeURIComponent(i.job_id) }, i.job_id)),
        h("td", {}, i.attempt), h("td", {}, i.cause),
        h("td", {}, (i.cluster || "-") + "/" + (i.flavor || "-")), h("td", {}, i.new_cluster || "waiting"),
        h("td", {}, i.resume_from_step ?? ""),
        h("td", { class: "num", "data-col": "placed" }, i.new_cluster ? moved(i.latency_s) : "waiting"),
        h("td", { class: "num", "data-col": "running" }, i.running_s === null || i.running_s === undefined
          ? "-" : dur(i.running_s)))),
      { "data-testid": "interruptions" }));
  };
  const reload = debounce(() => load().catch(fail), 500);
  load().catch(fail);
  return {
    onEvent: (ev) => { if (["preempting", "requeued", "admitted", "running"].includes(ev.kind)) reload(); },
    onOverflow: reload,
  };
}

// ---------------------------------------------------------------- routing and live events
function route() {
  generation += 1;
  const hash = location.hash.slice(1) || "/jobs";
  const [path, query] = hash.split("?");
  const parts = path.split("/").filter(Boolean);
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.dataset.page === (parts[0] === "job" ? "jobs" : parts[0]));
  }
  if (parts[0] === "fleet") page = fleetPage();
  else if (parts[0] === "queues") page = queuesPage();
  else if (parts[0] === "job" && parts[1]) page = jobPage(decodeURIComponent(parts[1]));
  else if (parts[0] === "interruptions") page = interruptionsPage();
  else page = jobsPage(query || "");
}

function connect() {
  const source = new EventSource("/api/events");
  source.addEventListener("hello", () => { liveBadge.textContent = "live"; liveBadge.className = "live on"; });
  source.onmessage = (msg) => { if (page) page.onEvent(JSON.parse(msg.data)); };
  source.addEventListener("overflow", () => { if (page) page.onOverflow(); });
  source.onerror = () => { liveBadge.textContent = "reconnecting"; liveBadge.className = "live off"; };
}

window.addEventListener("hashchange", route);
route();
connect();
