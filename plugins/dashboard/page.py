"""The dashboard page: self-contained HTML, its script shipped in this package (static/), charts
drawn as inline SVG. Nothing is fetched from a CDN: deployments and browsers may be offline."""

from __future__ import annotations

import functools
import html
import json
import re
from pathlib import Path

SCRIPT = Path(__file__).with_name("static") / "dashboard.js"

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><link rel="icon" href="data:,"><title>RLHF run __TITLE__</title>
<style>
 body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
 h1{font-size:18px;margin:0 0 8px} h2{font-size:15px;margin:0 0 6px}
 .bar{display:flex;gap:16px;align-items:center;flex-wrap:wrap;margin:6px 0 12px;color:#444}
 .grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(410px,1fr));gap:12px;margin-bottom:12px}
 .card{border:1px solid #ddd;border-radius:6px;padding:8px;background:#fff}
 .legend{font-size:11px;color:#555;margin:2px 0}
 table{border-collapse:collapse} td,th{padding:2px 8px;text-align:left;border-bottom:1px solid #eee;font-weight:normal}
 th{color:#555} .ok{color:#1a7f37} .wait{color:#9a6700} .err{color:#cf222e}
 .state{padding:2px 8px;border-radius:10px;background:#ddf4ff;color:#0969da;font-weight:600}
 .state.success{background:#dafbe1;color:#1a7f37} .state.failed{background:#ffebe9;color:#cf222e}
 svg text{font-size:10px;fill:#555} svg .grid{stroke:#eee} svg .axis{stroke:#aaa}
 svg .ev{stroke:#8250df;stroke-dasharray:3 3} svg .ev.replay_gate{stroke:#bc4c00} svg .evl{fill:#8250df}
</style></head><body>
<h1>RLHF run <code>__TITLE__</code> <span id="state" class="state">loading</span></h1>
<div class="bar">
 <label>x axis <select id="axis"><option value="step">trainer step</option><option value="time">wall time</option></select></label>
 <label><input type="checkbox" id="smooth" checked> smooth (EMA)</label>
 <label>weight <input type="range" id="alpha" min="0" max="0.98" step="0.02" value="0.6"> <span id="alphav">0.60</span></label>
 <span id="updated"></span> <span id="err" class="err"></span>
</div>
<div class="grid">
 <div class="card"><h2>Run</h2><table id="run"></table></div>
 <div class="card"><h2>Summary</h2><table id="summary"></table></div>
 <div class="card"><h2>Policy versions</h2><table id="policy"></table></div>
 <div class="card"><h2>Buffer now</h2><table id="buffer"></table></div>
 <div class="card"><h2>Phases and replay gates</h2><table id="phases"></table>
  <div class="legend">on every chart: P<i>k</i> = end of phase <i>k</i>, G<i>e</i> = replay gate <i>e</i> opened</div></div>
</div>
<div class="grid" id="charts"></div>
<script>
const STATUS_URL = __STATUS_URL__;
__SCRIPT__
</script></body></html>
"""


@functools.lru_cache(maxsize=1)
def _script() -> str:
    return SCRIPT.read_text(encoding="utf-8").replace("</", "<\\/")


def render_page(dag_id: str, run_id: str, status_url: str) -> str:
    """The page of one run. Every placeholder is filled in one pass, so text that came from the
    request (the run id, in the title and the status URL) is never scanned for placeholders again."""
    values = {
        "TITLE": html.escape(f"{dag_id} / {run_id}"),
        # json.dumps of a str is a JS string literal; with "<" escaped it cannot close the script.
        "STATUS_URL": json.dumps(status_url).replace("<", "\\u003c"),
        "SCRIPT": _script(),
    }
    return re.sub(r"__(TITLE|STATUS_URL|SCRIPT)__", lambda m: values[m.group(1)], _PAGE)
