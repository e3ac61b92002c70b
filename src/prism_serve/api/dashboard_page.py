"""The /dashboard page (api/dashboard.py serves it): one HTML document with its CSS and vanilla JS
inline, so it needs nothing but this server (no CDN, works offline) and ships inside the package as
a Python module, without package-data settings.

The script polls ``dashboard/state`` next to the page's own path every 1.5 s and rebuilds three
views from it: each device's budget as a stacked bar (weights and KV per model, then free), a
table of models, and, with tenants, a table of the tenants the key may see. Every rendered
number also sits raw in a ``data-value`` attribute (bars: ``data-bytes``), so tests and scripts
can read the page without parsing formatted text. Text from the server is set with
``textContent`` only (no HTML is built from data).
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>prism-serve dashboard</title>
<style>
  :root { --fg: #1f2937; --muted: #6b7280; --line: #e5e7eb; --free: #eef0f3; --bg: #f8fafc; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
         color: var(--fg); background: var(--bg); }
  header { display: flex; align-items: baseline; gap: 16px; padding: 14px 24px;
           background: #111827; color: #f9fafb; }
  header h1 { font-size: 18px; margin: 0; font-weight: 600; }
  header .sub { color: #9ca3af; font-size: 12px; }
  #status { margin-left: auto; font-size: 12px; color: #9ca3af; }
  #status.ok::before { content: "\25CF  "; color: #34d399; }
  #status.err { color: #fca5a5; }
  main { padding: 16px 24px 32px; max-width: 1400px; }
  h2 { font-size: 15px; margin: 18px 0 10px; color: var(--muted); font-weight: 600;
       text-transform: uppercase; letter-spacing: .04em; }
  #devices { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 14px; }
  .device { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px; }
  .device h3 { margin: 0 0 2px; font-size: 15px; }
  .device .meta { color: var(--muted); font-size: 12px; margin-bottom: 8px; }
  .bar { display: flex; height: 26px; border-radius: 5px; overflow: hidden; background: var(--free);
         border: 1px solid var(--line); }
  .seg { height: 100%; min-width: 0; }
  .seg.kv, .seg.spare, .sw.kv, .sw.spare {
    background-image: repeating-linear-gradient(45deg, rgba(255,255,255,.35) 0 4px, transparent 4px 8px); }
  .seg.free { background: var(--free); }
  .legend { list-style: none; padding: 0; margin: 8px 0 0; display: flex; flex-wrap: wrap; gap: 4px 14px;
            font-size: 12px; }
  .legend li { display: flex; align-items: center; gap: 5px; }
  .sw { width: 11px; height: 11px; border-radius: 2px; display: inline-block; border: 1px solid var(--line); }
  table { width: 100%; border-collapse: collapse; background: #fff; border: 1px solid var(--line);
          border-radius: 8px; overflow: hidden; }
  th, td { text-align: left; padding: 7px 10px; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { font-size: 12px; color: var(--muted); font-weight: 600; background: #f9fafb; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  tr:last-child td { border-bottom: 0; }
  .badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; }
  .badge.active { background: #d1fae5; color: #065f46; }
  .badge.loading { background: #fef3c7; color: #92400e; }
  .badge.evicted { background: #f3f4f6; color: #6b7280; }
  .pin { color: var(--muted); font-size: 11px; margin-left: 4px; }
  .miss { color: #b91c1c; }
  .muted { color: var(--muted); }
  #keyform { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px;
             margin-top: 14px; }
  #keyform input { font: inherit; padding: 5px 8px; width: 320px; }
  #keyform button { font: inherit; padding: 5px 12px; }
</style>
</head>
<body>
<header>
  <h1>prism-serve</h1><span class="sub" id="version"></span>
  <span class="sub" id="summary"></span>
  <span id="status">connecting&hellip;</span>
</header>
<main>
  <form id="keyform" hidden>
    <p>This server needs an API key to show its state. It is kept in this tab only
       (open <code>/dashboard#key=&lt;key&gt;</code> to pass it in the address).</p>
    <input id="key" type="password" autocomplete="off" placeholder="API key">
    <button type="submit">Show</button>
  </form>
  <h2>Devices</h2>
  <div id="devices"></div>
  <h2>Models</h2>
  <table id="models">
    <thead><tr>
      <th>Model</th><th>State</th><th>Device / replicas</th><th>Running</th><th>Queued</th>
      <th>KV in use</th><th>TTFT p50</th><th>TTFT p95</th><th>TTFT SLO met</th><th>TPOT SLO met</th>
      <th>Since start (TTFT / TPOT)</th><th>Activations</th>
    </tr></thead>
    <tbody></tbody>
  </table>
  <p class="muted" id="window"></p>
  <section id="tenants-section" hidden>
    <h2>Tenants</h2>
    <table id="tenants">
      <thead><tr>
        <th>Tenant</th><th>In flight</th><th>Requests / min</th><th>Tokens / min</th><th>Admitted</th>
        <th>Tokens</th><th>Rate limited (429)</th><th>TTFT SLO met</th><th>TPOT SLO met</th><th>SLO scale</th>
      </tr></thead>
      <tbody></tbody>
    </table>
    <p class="muted">Since the server started; a limit shows as used / limit, a dash without one.</p>
  </section>
</main>
<script>
"use strict";
const POLL_MS = 1500;
const STATE_URL = location.pathname.replace(/\/+$/, "") + "/state";
const KEY_ITEM = "prism-dashboard-key";

(function takeKeyFromFragment() {
  const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(KEY_ITEM, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);  // the key leaves the address bar
  }
})();

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "style") Object.assign(node.style, v);
    else if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n >= 100 ? 0 : n >= 10 ? 1 : 2)) + " " + units[i];
}
function fmtSeconds(s) {
  if (s === null || s === undefined) return "\u2013";
  return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms" : s.toFixed(s < 10 ? 2 : 1) + " s";
}
function fmtShare(x) {
  return x === null || x === undefined ? "\u2013" : (100 * x).toFixed(1) + "%";
}

function hue(name) {
  let h = 0;
  for (const ch of name) h = (h * 31 + ch.codePointAt(0)) >>> 0;
  return (h * 137) % 360;
}
function color(use) {
  if (use.kind === "other") return "hsl(220, 9%, 46%)";
  if (use.kind === "spare") return "hsl(220, 9%, 72%)";
  const h = hue(use.model);
  return use.kind === "weights" ? `hsl(${h}, 62%, 42%)` : `hsl(${h}, 70%, 68%)`;
}
function useLabel(use) {
  if (use.kind === "other") return use.name;
  if (use.kind === "spare") return "spare pages " + use.name.replace(/ spare$/, "");
  const who = use.replica ? `${use.model} #${use.replica}` : use.model;
  return `${who} ${use.kind === "kv" ? "KV" : "weights"}`;
}

function renderDevice(d) {
  const pct = (b) => (d.budget_bytes > 0 ? (100 * b) / d.budget_bytes : 0) + "%";
  const label = `${d.name}: ${fmtBytes(d.used_bytes)} of ${fmtBytes(d.budget_bytes)}`;
  const bar = el("div", { class: "bar", role: "img", "aria-label": label });
  const legend = el("ul", { class: "legend" });
  for (const u of d.uses) {
    if (u.bytes <= 0) continue;
    const c = color(u);
    bar.append(el("span", { class: "seg " + u.kind, "data-model": u.model, "data-replica": u.replica,
                            "data-kind": u.kind, "data-bytes": u.bytes,
                            title: `${useLabel(u)}: ${fmtBytes(u.bytes)}`,
                            style: { width: pct(u.bytes), backgroundColor: c } }));
    legend.append(el("li", {}, el("span", { class: "sw " + u.kind,
                                            style: { backgroundColor: c } }),
                     el("span", { class: "use-label" }, useLabel(u)),
                     el("span", { class: "muted", "data-bytes": u.bytes }, fmtBytes(u.bytes))));
  }
  bar.append(el("span", { class: "seg free", "data-kind": "free", "data-bytes": d.free_bytes,
                          title: `free: ${fmtBytes(d.free_bytes)}`, style: { width: pct(d.free_bytes) } }));
  legend.append(el("li", {}, el("span", { class: "sw", style: { backgroundColor: "var(--free)" } }),
                   el("span", { class: "use-label" }, "free"),
                   el("span", { class: "muted", "data-bytes": d.free_bytes }, fmtBytes(d.free_bytes))));
  return el("div", { class: "device", "data-device": d.name },
            el("h3", {}, d.name),
            el("div", { class: "meta" },
               el("span", { "data-field": "used_bytes", "data-value": d.used_bytes }, fmtBytes(d.used_bytes)),
               " mapped of ",
               el("span", { "data-field": "budget_bytes", "data-value": d.budget_bytes },
                  fmtBytes(d.budget_bytes)),
               ` (${fmtShare(d.budget_bytes ? d.used_bytes / d.budget_bytes : 0)})`),
            bar, legend);
}

function cell(field, value, text, cls) {
  return el("td", { "data-field": field, "data-value": value === null ? "" : value, class: cls }, text);
}

function renderModel(m) {
  const r = m.recent;
  const placement = m.replicas.length
    ? m.replicas.map((x) => x.device + (m.replicas.length > 1 ? ` (#${x.replica}${
        x.state === "loading" ? " loading" : ""})` : "")).join(", ")
    : "\u2013";
  const since = m.slo_attainment;
  const missed = (x) => (x !== null && x !== undefined && x < 1 ? "num miss" : "num");
  return el("tr", { "data-model": m.id },
    el("td", {}, el("b", { "data-field": "id" }, m.id),
       m.pinned ? el("span", { class: "pin" }, "pinned") : ""),
    el("td", {}, el("span", { class: "badge " + m.state, "data-field": "state", "data-value": m.state },
                    m.state)),
    cell("devices", m.replicas.map((x) => x.device).join(","), placement),
    cell("num_running", m.num_running, m.num_running, "num"),
    cell("num_queued", m.num_queued, m.num_queued, "num"),
    cell("kv_usage", m.kv_usage,
         m.max_kv_bytes ? `${fmtShare(m.kv_usage)} of ${fmtBytes(m.max_kv_bytes)}` + (m.cached_kv_bytes
           ? ` (+${fmtBytes(m.cached_kv_bytes)} cached, reclaimable)` : "") : "\u2013", "num"),
    cell("ttft_p50", r.ttft_p50, fmtSeconds(r.ttft_p50), "num"),
    cell("ttft_p95", r.ttft_p95, fmtSeconds(r.ttft_p95), "num"),
    cell("ttft_attainment", r.ttft_attainment, fmtShare(r.ttft_attainment), missed(r.ttft_attainment)),
    cell("tpot_attainment", r.tpot_attainment, fmtShare(r.tpot_attainment), missed(r.tpot_attainment)),
    cell("since_start", `${since.ttft ?? ""}/${since.tpot ?? ""}`,
         `${fmtShare(since.ttft)} / ${fmtShare(since.tpot)}`, "num"),
    cell("num_activations", m.num_activations, m.num_activations, "num"));
}

function renderTenant(t) {
  const lim = t.limits, att = t.slo_attainment;
  const used = (n, limit) => (limit === null || limit === undefined ? "\u2013" : `${n} / ${limit}`);
  const limited = Object.entries(t.rate_limited).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`);
  const missed = (x) => (x !== null && x !== undefined && x < 1 ? "num miss" : "num");
  return el("tr", { "data-tenant": t.tenant },
    el("td", {}, el("b", { "data-field": "tenant" }, t.tenant)),
    cell("in_flight", t.in_flight, used(t.in_flight, lim.concurrent_requests), "num"),
    cell("requests_last_minute", t.requests_last_minute,
         used(t.requests_last_minute, lim.requests_per_minute), "num"),
    cell("tokens_last_minute", t.tokens_last_minute,
         used(t.tokens_last_minute, lim.tokens_per_minute), "num"),
    cell("admitted", t.admitted, t.admitted, "num"),
    cell("tokens_used", t.tokens_used, t.tokens_used, "num"),
    cell("rate_limited", limited.length, limited.length ? limited.join(", ") : "0", "num"),
    cell("ttft_attainment", att.ttft, fmtShare(att.ttft), missed(att.ttft)),
    cell("tpot_attainment", att.tpot, fmtShare(att.tpot), missed(att.tpot)),
    cell("slo_scale", t.slo_scale, "\u00d7" + t.slo_scale, "num"));
}

function render(s) {
  document.getElementById("version").textContent = "v" + s.version;
  document.getElementById("devices").replaceChildren(...s.devices.map(renderDevice));
  document.querySelector("#models tbody").replaceChildren(...s.models.map(renderModel));
  document.querySelector("#tenants tbody").replaceChildren(...s.tenants.map(renderTenant));
  document.getElementById("tenants-section").hidden = s.tenants.length === 0;
  const active = s.models.filter((m) => m.state === "active").length;
  const running = s.models.reduce((a, m) => a + m.num_running, 0);
  const queued = s.models.reduce((a, m) => a + m.num_queued, 0);
  document.getElementById("summary").textContent =
    `${active} of ${s.models.length} models active \u00b7 ${running} running \u00b7 ${queued} queued`;
  const w = s.models.length ? s.models[0].recent.window_s : 60;
  document.getElementById("window").textContent =
    `TTFT percentiles and SLO met: requests finished or failed in the last ${w} s (failed ones count as ` +
    "missed). Bars: each device's memory budget as its ledger maps it; striped: KV cache (in the " +
    "model's colour) and spare pages no model uses (grey; reclaimable).";
  document.body.dataset.updated = String(s.created);
}

function setStatus(text, ok) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.className = ok ? "ok" : "err";
}

let timer = null;
async function poll() {
  clearTimeout(timer);
  const key = sessionStorage.getItem(KEY_ITEM);
  try {
    const r = await fetch(STATE_URL, { cache: "no-store",
                                       headers: key ? { Authorization: "Bearer " + key } : {} });
    if (r.status === 401) {
      sessionStorage.removeItem(KEY_ITEM);
      document.getElementById("keyform").hidden = false;
      setStatus(key ? "that key was refused" : "an API key is needed", false);
      return;  // polling resumes when a key is entered
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    document.getElementById("keyform").hidden = true;
    setStatus("live \u00b7 updated " + new Date().toLocaleTimeString(), true);
  } catch (e) {
    setStatus("cannot reach the server (" + e.message + "); retrying", false);
  }
  timer = setTimeout(poll, POLL_MS);
}

document.getElementById("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_ITEM, document.getElementById("key").value.trim());
  poll();
});
poll();
</script>
</body>
</html>
"""
