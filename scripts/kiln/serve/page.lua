-- kiln.serve.page: the status page kiln serve answers at / : the queue, the run in
-- progress with its preview, the last finished picture, the last run's memory curve and
-- each device's memory over the last minutes (SVG polylines, so the page's DOM holds the
-- curves), drawn from the server's own endpoints (/queue, /sdapi/v1/progress, /history,
-- /system_stats) once a second. Plain HTML and JavaScript, no framework, no
-- file outside the binary. With --token, open it as /?token=T (the page passes it on).
local M = {}

M.html = [==[<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln serve</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#222}
h1{font-size:1.3em;margin:0 0 .8em} section{display:inline-block;vertical-align:top;margin:0 2em 1.5em 0}
h2{font-size:1em;margin:.2em 0 .5em} img{image-rendering:pixelated;border:1px solid #ccc;background:#fff}
#bar{width:260px;height:12px;border:1px solid #999;background:#fff} #fill{height:100%;width:0;background:#3a7}
table{border-collapse:collapse} td{padding:1px 8px 1px 0} svg{border:1px solid #ccc;background:#fff}
svg text{font:11px system-ui,sans-serif} polyline{fill:none;stroke-width:1.5} .budget{stroke:#999;stroke-dasharray:4 3}
</style></head><body>
<h1>kiln serve</h1>
<section><h2>Queue</h2><div id="queue">-</div></section>
<section><h2>Run</h2><div id="bar"><div id="fill"></div></div><div id="step">idle</div>
<img id="preview" width="256" height="256" alt="preview"></section>
<section><h2>Last picture</h2><img id="last" width="256" height="256" alt="last picture"><div id="lastname"></div></section>
<section><h2>Memory: the last run</h2><svg id="runmem" width="520" height="200" viewBox="0 0 520 200"></svg>
<div id="runinfo"></div></section>
<section><h2>Memory: now</h2><svg id="mem" width="520" height="200" viewBox="0 0 520 200"></svg><table id="devs"></table></section>
<script>
"use strict";
const tok = new URLSearchParams(location.search).get("token");
const q = p => p + (tok ? (p.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(tok) : "");
const get = p => fetch(q(p), {cache: "no-store"}).then(r => r.ok ? r.json() : Promise.reject(r.status));
const NS = "http://www.w3.org/2000/svg";
const hist = {}; const colors = ["#c33", "#36c", "#393", "#c93"];
function mib(b) { return (b / 1048576).toFixed(1) + " MiB"; }
function el(parent, name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e); return e;
}
// curves: {device: [bytes...]} drawn left to right across the plot, each a polyline
// (class cls, data-device) scaled to the largest value or budget shown
function plot(svg, curves, budgets, cls, label) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 520, H = 200, top = 18, bottom = 6;
  let ymax = 1;
  for (const d in curves) for (const v of curves[d]) ymax = Math.max(ymax, v);
  for (const d in budgets) if (budgets[d] > 0 && budgets[d] < 4 * ymax) ymax = Math.max(ymax, budgets[d]);
  const y = v => (H - bottom - v / ymax * (H - top - bottom)).toFixed(1);
  let i = 0;
  for (const d in curves) {
    const h = curves[d], color = colors[i++ % colors.length], n = Math.max(h.length - 1, 1);
    const pts = h.map((v, k) => (k * (W - 2) / n + 1).toFixed(1) + "," + y(v)).join(" ");
    el(svg, "polyline", {points: pts, stroke: color, "class": cls, "data-device": d});
    if (budgets[d] > 0 && budgets[d] <= ymax)
      el(svg, "line", {x1: 0, x2: W, y1: y(budgets[d]), y2: y(budgets[d]), "class": "budget"});
    el(svg, "text", {x: 6, y: 14 * i, fill: color}, d);
  }
  el(svg, "text", {x: W - 170, y: 14, fill: "#666"}, label + " " + mib(ymax));
}
let lastShown = "", lastRun = "";
async function tick() {
  try {
    const [queue, prog, stats, history] = await Promise.all([get("/queue"), get("/sdapi/v1/progress"),
      get("/system_stats"), get("/history?max_items=1")]);
    document.getElementById("queue").textContent =
      queue.queue_running.length + " running, " + queue.queue_pending.length + " waiting (" +
      stats.kiln.queue_remaining + " in all)";
    const s = prog.state;
    document.getElementById("fill").style.width = (100 * prog.progress).toFixed(1) + "%";
    document.getElementById("step").textContent = s.sampling_steps ? ("step " + s.sampling_step + " / " + s.sampling_steps) : "idle";
    if (prog.current_image) document.getElementById("preview").src = "data:image/png;base64," + prog.current_image;
    const devs = stats.kiln.devices, budgets = {};
    let rows = "<tr><td>device</td><td>allocated</td><td>peak</td><td>budget</td></tr>";
    for (const d in devs) {
      (hist[d] = hist[d] || []).push(devs[d].allocated || 0);
      if (hist[d].length > 260) hist[d].shift();
      budgets[d] = devs[d].budget || 0;
      rows += "<tr><td>" + d + "</td><td>" + mib(devs[d].allocated || 0) + "</td><td>" + mib(devs[d].peak || 0) +
        "</td><td>" + (devs[d].budget ? mib(devs[d].budget) : "none") + "</td></tr>";
    }
    document.getElementById("devs").innerHTML = rows;
    plot(document.getElementById("mem"), hist, budgets, "live", "top");
    const run = stats.kiln.last_run_memory;
    if (run && run.devices && JSON.stringify(run) !== lastRun) {
      lastRun = JSON.stringify(run);
      const curves = {}, rb = {}, info = [];
      for (const d in run.devices) {
        const r = run.devices[d];
        curves[d] = r.bytes; rb[d] = r.budget;
        info.push(d + ": peak " + mib(r.peak) + " in " + r.seconds.toFixed(2) + " s (" +
          r.stages.map(st => st.name + " " + mib(st.peak)).join(", ") + ")");
      }
      plot(document.getElementById("runmem"), curves, rb, "run", "top");
      document.getElementById("runinfo").textContent = info.join("; ");
    }
    for (const id in history) {
      for (const n in history[id].outputs) {
        const im = (history[id].outputs[n].images || [])[0];
        if (!im) continue;
        const src = "/view?filename=" + encodeURIComponent(im.filename) + "&subfolder=" + encodeURIComponent(im.subfolder) + "&type=" + im.type;
        if (src !== lastShown) {
          lastShown = src;
          const img = document.getElementById("last");
          // the caption says the size the browser decoded: the picture is shown, not only named
          img.onload = () => { document.getElementById("lastname").textContent =
            im.filename + ", " + img.naturalWidth + "\u00d7" + img.naturalHeight; };
          img.src = q(src);
          document.getElementById("lastname").textContent = im.filename;
        }
      }
    }
  } catch (e) { document.getElementById("step").textContent = "server: " + e; }
}
tick(); setInterval(tick, 1000);
</script></body></html>
]==]

return M
