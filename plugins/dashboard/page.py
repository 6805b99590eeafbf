"""The dashboard page: self-contained HTML + inline SVG charts (no CDN: deployments may be offline)."""

from __future__ import annotations

import html
import json

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>RLHF run __TITLE__</title>
<style>
 body{font:14px system-ui,sans-serif;margin:16px;color:#222}
 h1{font-size:18px;margin:0 0 8px} h2{font-size:15px;margin:18px 0 6px}
 .grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:12px}
 .card{border:1px solid #ddd;border-radius:6px;padding:8px}
 table{border-collapse:collapse} td,th{padding:2px 8px;text-align:left;border-bottom:1px solid #eee}
 .ok{color:#1a7f37} .wait{color:#9a6700} .err{color:#cf222e} svg text{font-size:10px;fill:#555}
</style></head><body>
<h1>RLHF run <code>__TITLE__</code></h1>
<div id="err" class="err"></div>
<div class="grid">
 <div class="card"><h2>Run</h2><table id="run"></table></div>
 <div class="card"><h2>Phases and replay gates</h2><table id="phases"></table></div>
 <div class="card"><h2>Buffer tiers</h2><table id="buffer"></table></div>
 <div class="card"><h2>Policy</h2><table id="policy"></table></div>
</div>
<h2>Curves</h2><div class="grid" id="charts"></div>
<script>
const STATUS_URL = __STATUS_URL__;
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;","\\"":"&quot;","'":"&#39;"}[c]));
function rows(el, obj){ document.getElementById(el).innerHTML = Object.entries(obj||{})
  .map(([k,v]) => `<tr><th>${esc(k)}</th><td>${esc(typeof v==="object"&&v!==null?JSON.stringify(v):v)}</td></tr>`).join(""); }
function chart(title, pts){
  const W=320,H=150,P=30; if(!pts.length) return "";
  const xs=pts.map(p=>p[0]), ys=pts.map(p=>p[1]);
  const x0=Math.min(...xs), x1=Math.max(...xs)||1, y0=Math.min(...ys), y1=Math.max(...ys);
  const sx=x=>P+(W-P-5)*(x1===x0?0.5:(x-x0)/(x1-x0)), sy=y=>H-P+(-(H-P-5))*(y1===y0?0.5:(y-y0)/(y1-y0));
  const d=pts.map((p,i)=>(i?"L":"M")+sx(p[0]).toFixed(1)+","+sy(p[1]).toFixed(1)).join(" ");
  return `<div class="card"><b>${esc(title)}</b><svg width="${W}" height="${H}">
   <path d="${d}" fill="none" stroke="#0969da" stroke-width="1.5"/>
   <line x1="${P}" y1="${H-P}" x2="${W}" y2="${H-P}" stroke="#aaa"/><line x1="${P}" y1="0" x2="${P}" y2="${H-P}" stroke="#aaa"/>
   <text x="${P}" y="${H-P+12}">${x0}</text><text x="${W-30}" y="${H-P+12}">${x1}</text>
   <text x="0" y="10">${(+y1).toPrecision(3)}</text><text x="0" y="${H-P}">${(+y0).toPrecision(3)}</text>
   <text x="${W/2-20}" y="${H-4}">step</text></svg></div>`;
}
async function refresh(){
  try{
    const r = await fetch(STATUS_URL, {credentials:"same-origin"});
    if(!r.ok){ document.getElementById("err").textContent = `status: HTTP ${r.status}`; return; }
    const s = await r.json(); document.getElementById("err").textContent = "";
    rows("run", {run_id:s.run_id, run_url:s.run_url, ...s.config, trainer_done:s.trainer_done, stopped:s.stopped});
    document.getElementById("phases").innerHTML = (s.phases||[]).map(p =>
      `<tr><th>${p.kind==="phase"?"phase":"replay epoch"} ${p.index}</th><td class="${p.done?"ok":"wait"}">${p.done?"done":"waiting"}</td>
       <td>${p.step!=null?"step "+esc(p.step):p.eligible!=null?esc(p.eligible)+" eligible groups":""}</td></tr>`).join("");
    rows("buffer", s.buffer || {buffer:"no data yet"});
    rows("policy", {latest:s.policy.latest, versions:(s.policy.versions||[]).join(", "), summary:s.summary?"written":"not yet"});
    const charts=[];
    for(const [stream, curves] of Object.entries(s.curves||{}))
      for(const [k, pts] of Object.entries(curves)) charts.push(chart(stream+" "+k, pts));
    document.getElementById("charts").innerHTML = charts.join("") || "<i>no metrics yet</i>";
  }catch(e){ document.getElementById("err").textContent = String(e); }
}
refresh(); setInterval(refresh, 5000);
</script></body></html>
"""


def render_page(dag_id: str, run_id: str, status_url: str) -> str:
    title = html.escape(f"{dag_id} / {run_id}")
    # json.dumps of a str is a JS string literal; "</" is escaped so it cannot close the script.
    return _PAGE.replace("__TITLE__", title).replace("__STATUS_URL__", json.dumps(status_url).replace("</", "<\\/"))
