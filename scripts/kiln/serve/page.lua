-- kiln.serve.page: the status page kiln serve answers at / : the queue, the run in
-- progress with its preview, the last finished picture and each device's memory over
-- the last minutes, drawn from the server's own endpoints (/queue, /sdapi/v1/progress,
-- /history, /system_stats) once a second. Plain HTML and JavaScript, no framework, no
-- file outside the binary. With --token, open it as /?token=T (the page passes it on).
local M = {}

M.html = [==[<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kiln serve</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#222}
h1{font-size:1.3em;margin:0 0 .8em} section{display:inline-block;vertical-align:top;margin:0 2em 1.5em 0}
h2{font-size:1em;margin:.2em 0 .5em} img{image-rendering:pixelated;border:1px solid #ccc;background:#fff}
#bar{width:260px;height:12px;border:1px solid #999;background:#fff} #fill{height:100%;width:0;background:#3a7}
table{border-collapse:collapse} td{padding:1px 8px 1px 0} canvas{border:1px solid #ccc;background:#fff}
</style></head><body>
<h1>kiln serve</h1>
<section><h2>Queue</h2><div id="queue">-</div></section>
<section><h2>Run</h2><div id="bar"><div id="fill"></div></div><div id="step">idle</div>
<img id="preview" width="256" height="256" alt="preview"></section>
<section><h2>Last picture</h2><img id="last" width="256" height="256" alt="last picture"><div id="lastname"></div></section>
<section><h2>Memory</h2><canvas id="mem" width="520" height="200"></canvas><table id="devs"></table></section>
<script>
"use strict";
const tok = new URLSearchParams(location.search).get("token");
const q = p => p + (tok ? (p.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(tok) : "");
const get = p => fetch(q(p), {cache: "no-store"}).then(r => r.ok ? r.json() : Promise.reject(r.status));
const hist = {}; const colors = ["#c33", "#36c", "#393", "#c93"];
function mib(b) { return (b / 1048576).toFixed(1) + " MiB"; }
function draw() {
  const c = document.getElementById("mem"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  let top = 1;
  for (const d in hist) for (const v of hist[d]) top = Math.max(top, v);
  let i = 0;
  for (const d in hist) {
    const h = hist[d]; g.strokeStyle = colors[i++ % colors.length]; g.beginPath();
    h.forEach((v, k) => { const x = c.width - (h.length - k) * 2, y = c.height - 4 - v / top * (c.height - 20);
      k ? g.lineTo(x, y) : g.moveTo(x, y); });
    g.stroke(); g.fillStyle = g.strokeStyle; g.fillText(d, 6, 14 * i);
  }
  g.fillStyle = "#666"; g.fillText("peak shown " + mib(top), c.width - 140, 14);
}
let lastShown = "";
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
    const devs = stats.kiln.devices; let rows = "<tr><td>device</td><td>allocated</td><td>peak</td><td>budget</td></tr>";
    for (const d in devs) {
      (hist[d] = hist[d] || []).push(devs[d].allocated || 0);
      if (hist[d].length > 260) hist[d].shift();
      rows += "<tr><td>" + d + "</td><td>" + mib(devs[d].allocated || 0) + "</td><td>" + mib(devs[d].peak || 0) +
        "</td><td>" + (devs[d].budget ? mib(devs[d].budget) : "none") + "</td></tr>";
    }
    document.getElementById("devs").innerHTML = rows;
    draw();
    for (const id in history) {
      for (const n in history[id].outputs) {
        const im = (history[id].outputs[n].images || [])[0];
        if (!im) continue;
        const src = "/view?filename=" + encodeURIComponent(im.filename) + "&subfolder=" + encodeURIComponent(im.subfolder) + "&type=" + im.type;
        if (src !== lastShown) { lastShown = src; document.getElementById("last").src = q(src);
          document.getElementById("lastname").textContent = im.filename; }
      }
    }
  } catch (e) { document.getElementById("step").textContent = "server: " + e; }
}
tick(); setInterval(tick, 1000);
</script></body></html>
]==]

return M
