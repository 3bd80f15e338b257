"""PAGE: the live status page served at GET /dashboard — plain HTML, CSS and one small inline script, no
build step and nothing fetched from elsewhere. The script polls GET /dashboard/data every second and
writes the numbers with textContent (never as HTML: error messages can quote what a client sent). With
--api-key, open /dashboard#key=KEY: the fragment never leaves the browser except as the Authorization
header of the data request. ICON: the server's icon (GET /favicon.ico), three fish of a shoal."""

ICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><g fill="#0ea5e9">'
        '<path d="M1 4l3-2v4zM4 4c2-2 5-2 6 0-1 2-4 2-6 0z"/><path d="M6 12l3-2v4zM9 12c2-2 5-2 6 0-1 2-4 2-6 0z"/>'
        '<path d="M1 9l2-1.5v3zM3 9c1.5-1.5 4-1.5 5 0-1 1.5-3.5 1.5-5 0z"/></g></svg>')

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Shoal status</title>
<link rel="icon" href="favicon.ico" type="image/svg+xml">
<style>
  body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; background: #f3f5f8;
         color: #1f2933; }
  header { display: flex; justify-content: space-between; align-items: baseline; padding: 14px 24px;
           background: #1e293b; color: #f8fafc; }
  header strong { font-size: 18px; margin-right: 10px; }
  header .muted { color: #94a3b8; }
  #status.live { color: #4ade80; }
  #status.bad { color: #f87171; }
  main { padding: 18px 24px; display: grid; gap: 16px; max-width: 1280px; }
  .cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(130px, 1fr)); gap: 12px; }
  .card, section { background: #fff; border-radius: 8px; padding: 12px 14px;
                   box-shadow: 0 1px 2px rgba(15, 23, 42, .08); }
  .label { color: #64748b; font-size: 11px; text-transform: uppercase; letter-spacing: .04em; white-space: nowrap;
           overflow: hidden; text-overflow: ellipsis; }
  .value { font-size: 26px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .sub { color: #64748b; font-size: 12px; }
  .meter { display: flex; height: 8px; background: #e2e8f0; border-radius: 4px; overflow: hidden; margin-top: 6px; }
  .meter span { display: block; height: 100%; }
  .used { background: #2563eb; } .cached { background: #93c5fd; }
  h2 { font-size: 13px; margin: 0 0 8px; color: #334155; text-transform: uppercase; letter-spacing: .05em; }
  h2 small { text-transform: none; color: #94a3b8; font-weight: normal; letter-spacing: 0; }
  .two { display: grid; grid-template-columns: repeat(auto-fit, minmax(380px, 1fr)); gap: 16px; }
  table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
  th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eef2f7; vertical-align: top; }
  th { color: #64748b; font-weight: 500; font-size: 12px; }
  td.msg { word-break: break-word; color: #475569; }
  .up { color: #16a34a; font-weight: 600; } .down { color: #dc2626; font-weight: 600; }
  .share { display: inline-block; height: 8px; background: #2563eb; border-radius: 4px; vertical-align: middle; }
  svg { width: 100%; height: 130px; display: block; }
  polyline { fill: none; stroke-width: 2; vector-effect: non-scaling-stroke; }
  #tok-line { stroke: #2563eb; } #req-line { stroke: #f59e0b; }
  .legend span { margin-right: 16px; } .dot { display: inline-block; width: 10px; height: 3px; margin-right: 5px;
                                                vertical-align: middle; }
</style>
</head>
<body>
<header>
  <div><strong>Shoal</strong><span id="model" class="muted">&ndash;</span></div>
  <div><span id="status">connecting&hellip;</span> <span class="muted">&middot; up <span id="uptime">&ndash;</span>
    &middot; <span id="updates">0</span> updates</span></div>
</header>
<main>
  <div class="cards">
    <div class="card"><div class="label">Requests / s</div><div class="value" id="requests-per-s">&ndash;</div>
      <div class="sub"><span id="requests-total">0</span> finished</div></div>
    <div class="card"><div class="label">Output tok / s</div>
      <div class="value" id="generation-tokens-per-s">&ndash;</div></div>
    <div class="card"><div class="label">Prompt tok / s</div><div class="value" id="prompt-tokens-per-s">&ndash;</div></div>
    <div class="card"><div class="label">Running</div><div class="value" id="running">&ndash;</div></div>
    <div class="card"><div class="label">Waiting</div><div class="value" id="waiting">&ndash;</div></div>
    <div class="card"><div class="label">Decode batch</div><div class="value" id="batch-size">&ndash;</div>
      <div class="sub">requests per decode step</div></div>
    <div class="card"><div class="label">KV usage</div><div class="value" id="kv-usage">&ndash;</div>
      <div class="meter"><span class="used" id="kv-used-bar"></span><span class="cached" id="kv-cache-bar"></span></div>
      <div class="sub">+ <span id="kv-cache">&ndash;</span> prefix cache</div></div>
    <div class="card"><div class="label">Prefix cache hit</div><div class="value" id="cache-hit">&ndash;</div>
      <div class="sub">of prompt tokens looked up</div></div>
  </div>
  <section>
    <h2>Throughput <small>last two minutes</small></h2>
    <svg viewBox="0 0 600 130" preserveAspectRatio="none"><polyline id="tok-line"></polyline>
      <polyline id="req-line"></polyline></svg>
    <div class="sub legend"><span><i class="dot" style="background:#2563eb"></i>generated tokens / s
      (peak <b id="tok-peak">0</b>)</span><span><i class="dot" style="background:#f59e0b"></i>requests / s
      (peak <b id="req-peak">0</b>)</span></div>
  </section>
  <div class="two">
    <section><h2>Forward modes <small id="window"></small></h2>
      <table><thead><tr><th>mode</th><th>batches</th><th>tokens</th><th>share of tokens</th></tr></thead>
        <tbody id="modes"></tbody></table></section>
    <section><h2>Replicas</h2>
      <table><thead><tr><th>#</th><th>state</th><th>running</th><th>waiting</th><th>KV</th><th>tokens / s</th></tr></thead>
        <tbody id="replicas"></tbody></table></section>
  </div>
  <section><h2>Recent errors <small id="errors-total"></small></h2>
    <table><thead><tr><th>time</th><th>route</th><th>status</th><th>code</th><th>message</th></tr></thead>
      <tbody id="errors"></tbody></table></section>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const key = new URLSearchParams(location.hash.slice(1)).get("key");
let updates = 0;

const num = (x, digits = 1) => x == null ? "\\u2013"
  : x.toLocaleString(undefined, {minimumFractionDigits: digits, maximumFractionDigits: digits});
const pct = (x) => x == null ? "\\u2013" : (100 * x).toFixed(1) + "%";
function duration(s) {
  const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60;
  return h ? `${h} h ${m} min` : m ? `${m} min ${Math.floor(s % 60)} s` : `${Math.floor(s)} s`;
}
function cell(content, cls) {
  const td = document.createElement("td");
  if (content instanceof Node) td.append(content); else td.textContent = content;
  if (cls) td.className = cls;
  return td;
}
function fill(tbody, rows, empty, width) {
  if (!rows.length) rows = [[cell(empty, "sub")]];
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    tr.append(...cells.map((c) => c instanceof HTMLTableCellElement ? c : cell(c)));
    if (cells.length === 1) tr.firstChild.colSpan = width;
    return tr;
  }));
}
function share(fraction) {
  const span = document.createElement("span");
  span.className = "share";
  span.style.width = Math.max(2, 120 * fraction) + "px";
  span.title = pct(fraction);
  return span;
}
function line(el, values) {
  const peak = Math.max(...values, 0);
  const top = peak > 0 ? peak * 1.1 : 1;
  el.setAttribute("points", values.map((v, i) =>
    `${(600 * i / Math.max(values.length - 1, 1)).toFixed(1)},${(126 - 120 * v / top).toFixed(1)}`).join(" "));
  return peak;
}
function render(d) {
  $("model").textContent = d.model || "(loading the model)";
  $("uptime").textContent = duration(d.uptime_s);
  $("requests-per-s").textContent = num(d.requests_per_s, 2);
  $("requests-total").textContent = d.requests_total.toLocaleString();
  $("generation-tokens-per-s").textContent = num(d.generation_tokens_per_s);
  $("prompt-tokens-per-s").textContent = num(d.prompt_tokens_per_s);
  $("running").textContent = d.running;
  $("waiting").textContent = d.waiting;
  $("batch-size").textContent = num(d.batch_size);
  $("kv-usage").textContent = pct(d.kv_usage);
  $("kv-cache").textContent = pct(d.kv_cache);
  $("kv-used-bar").style.width = pct(d.kv_usage);
  $("kv-cache-bar").style.width = pct(d.kv_cache);
  $("cache-hit").textContent = pct(d.cache_hit_rate);
  $("window").textContent = d.window_s > 1 ? `last ${duration(d.window_s)}` : "since start";
  const tokens = d.modes.reduce((sum, m) => sum + m.tokens, 0) || 1;
  fill($("modes"), d.modes.map((m) => [m.mode, m.batches.toLocaleString(), m.tokens.toLocaleString(),
                                       share(m.tokens / tokens)]), "no batches yet", 4);
  fill($("replicas"), d.replicas.map((r) => [String(r.index), cell(r.up ? "up" : "down", r.up ? "up" : "down"),
                                             String(r.running), String(r.waiting), pct(r.kv_usage),
                                             num(r.tokens_per_s)]), "no engine yet", 6);
  $("errors-total").textContent = `${d.errors_total} since start`;
  fill($("errors"), d.errors.map((e) => [new Date(e.at * 1000).toLocaleTimeString(), `${e.method} ${e.path}`,
                                         String(e.status), e.code || "", cell(e.message, "msg")]), "none", 5);
  $("tok-peak").textContent = num(line($("tok-line"), d.history.map((p) => p[2])));
  $("req-peak").textContent = num(line($("req-line"), d.history.map((p) => p[1])), 2);
  $("updates").textContent = ++updates;
}
function status(text, cls) {
  $("status").textContent = text;
  $("status").className = cls;
}
async function tick() {
  try {
    const r = await fetch("dashboard/data", {cache: "no-store", headers: key ? {Authorization: `Bearer ${key}`} : {}});
    if (r.status === 401) status("needs the API key: open /dashboard#key=<key>", "bad");
    else if (!r.ok) status(`error ${r.status}`, "bad");
    else {
      const d = await r.json();
      render(d);
      status(d.ready ? "live" : "starting", d.ready ? "live" : "");
    }
  } catch (e) {
    status("unreachable", "bad");
  }
  setTimeout(tick, 1000);
}
tick();
</script>
</body>
</html>
"""
