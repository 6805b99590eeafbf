// The RLHF run dashboard: polls the status endpoint and draws every chart as inline SVG.
// No libraries and no network access beyond the status endpoint (deployments may be offline).
"use strict";
const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bc4c00", "#57606a"];
const TERMINAL = new Set(["success", "failed"]);
const ui = {axis: "step", smooth: true, alpha: 0.6};
let last = null, timer = null;
const $ = id => document.getElementById(id);
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;"}[c]));
const isNum = v => typeof v === "number" && isFinite(v);

function fmt(v) {
  if (!isNum(v)) return v == null ? "–" : String(v);
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  return v === 0 ? "0" : v.toPrecision(2);
}
function dur(s) {
  s = Math.round(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}

// Debiased exponential moving average (as TensorBoard's smoothing): gaps stay gaps.
function ema(ys, alpha) {
  let acc = 0, w = 0;
  return ys.map(y => {
    if (!isNum(y)) return null;
    acc = alpha * acc + (1 - alpha) * y; w = alpha * w + (1 - alpha);
    return acc / w;
  });
}

// The shared x axis: trainer step, or seconds since the run's first record.
function axisOf(s) {
  const tr = ((s.charts || {}).streams || {}).trainer || {x: [], t: []};
  const starts = Object.values((s.charts || {}).streams || {}).map(st => st.t && st.t[0]).filter(isNum);
  const t0 = starts.length ? Math.min(...starts) : 0;
  const stepAt = t => {  // wall time -> trainer step, by interpolation over the trainer's records
    const T = tr.t, X = tr.x;
    if (!T.length) return null;
    if (t <= T[0]) return T[0] > t0 ? X[0] * Math.max(t - t0, 0) / (T[0] - t0) : X[0];
    if (t >= T[T.length - 1]) return X[X.length - 1];
    let lo = 0, hi = T.length - 1;
    while (hi - lo > 1) { const m = (lo + hi) >> 1; if (T[m] <= t) lo = m; else hi = m; }
    return X[lo] + (X[hi] - X[lo]) * (t - T[lo]) / ((T[hi] - T[lo]) || 1);
  };
  const timeAt = step => {
    const i = tr.x.findIndex(x => x >= step);
    return i < 0 ? null : tr.t[i];
  };
  return {
    label: ui.axis === "step" ? "trainer step" : "wall time",
    fromTime: t => ui.axis === "step" ? stepAt(t) : t - t0,
    fromStep: st => ui.axis === "step" ? st : (timeAt(st) == null ? null : timeAt(st) - t0),
    tick: v => ui.axis === "step" ? fmt(v) : dur(v),
  };
}

// Series of a stream: xs on the chosen axis (the trainer has steps, every stream has times).
function streamSeries(ax, st, key, name, color, isTrainer) {
  if (!st || !st[key]) return null;
  const xs = isTrainer && ui.axis === "step" ? st.x : st.t.map(ax.fromTime);
  return {name, xs, ys: st[key], color, smooth: true};
}

function chart(id, title, series, ax, opts = {}) {
  series = series.filter(s => s && s.xs.length);
  const W = 400, H = 190, L = 46, R = 10, T = 10, B = 34;
  let n = 0, body = "";
  const pts = [];
  for (const s of series) s.xs.forEach((x, i) => { if (isNum(x) && isNum(s.ys[i])) pts.push([x, s.ys[i]]); });
  if (!pts.length) {
    return `<div class="card"><b>${esc(title)}</b><svg data-chart="${id}" data-points="0" width="${W}" height="${H}">
      <text x="${W / 2 - 40}" y="${H / 2}">${esc(opts.empty || "no data yet")}</text></svg></div>`;
  }
  let [x0, x1] = [Math.min(...pts.map(p => p[0])), Math.max(...pts.map(p => p[0]))];
  let [y0, y1] = [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (opts.zero) y0 = Math.min(y0, 0);
  if (opts.ymax != null) y1 = Math.max(y1, opts.ymax);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.05; y0 -= opts.zero && y0 === 0 ? 0 : pad; y1 += pad;
  const sx = x => L + (W - L - R) * (x - x0) / (x1 - x0), sy = y => T + (H - T - B) * (1 - (y - y0) / (y1 - y0));
  let grid = "";
  for (let k = 0; k <= 4; k++) {
    const yv = y0 + (y1 - y0) * k / 4, xv = x0 + (x1 - x0) * k / 4;
    grid += `<line x1="${L}" x2="${W - R}" y1="${sy(yv).toFixed(1)}" y2="${sy(yv).toFixed(1)}" class="grid"/>
      <text x="2" y="${(sy(yv) + 3).toFixed(1)}">${fmt(yv)}</text>
      <text x="${(sx(xv) - 12).toFixed(1)}" y="${H - B + 13}">${ax.tick(xv)}</text>`;
  }
  for (const e of (opts.events || [])) {
    const x = e.kind === "phase" ? ax.fromStep(e.step) : (isNum(e.t) ? ax.fromTime(e.t) : null);
    if (!isNum(x) || x < x0 || x > x1) continue;
    const lab = e.kind === "phase" ? "P" + e.index : "G" + e.index;
    body += `<line x1="${sx(x).toFixed(1)}" x2="${sx(x).toFixed(1)}" y1="${T}" y2="${H - B}" class="ev ${e.kind}"/>
      <text x="${(sx(x) + 2).toFixed(1)}" y="${T + 9}" class="evl">${lab}</text>`;
  }
  for (const s of series) {
    const ys = ui.smooth && s.smooth && !opts.raw ? ema(s.ys, ui.alpha) : s.ys;
    if (s.kind === "points") {
      s.xs.forEach((x, i) => {
        if (!isNum(x) || !isNum(s.ys[i])) return;
        n++;
        body += `<circle cx="${sx(x).toFixed(1)}" cy="${sy(s.ys[i]).toFixed(1)}" r="4" fill="${s.color}"/>
          <text x="${(sx(x) + (sx(x) > W - 60 ? -34 : 6)).toFixed(1)}" y="${(sy(s.ys[i]) - 6).toFixed(1)}">${fmt(s.ys[i])}</text>`;
      });
      continue;
    }
    const path = (vals) => {
      let d = "", pen = false;
      s.xs.forEach((x, i) => {
        if (!isNum(x) || !isNum(vals[i])) { pen = false; return; }
        d += (pen ? "L" : "M") + sx(x).toFixed(1) + "," + sy(vals[i]).toFixed(1); pen = true;
      });
      return d;
    };
    if (ys !== s.ys) body += `<path d="${path(s.ys)}" fill="none" stroke="${s.color}" stroke-width="1" opacity="0.25"/>`;
    const d = path(ys);
    n += (d.match(/[ML]/g) || []).length;
    body += `<path d="${d}" fill="none" stroke="${s.color}" stroke-width="1.6" class="series"/>`;
  }
  const legend = series.map(s => `<span style="color:${s.color}">■</span> ${esc(s.name)}`).join(" &nbsp;");
  return `<div class="card"><b>${esc(title)}</b><div class="legend">${legend}</div>
    <svg data-chart="${id}" data-points="${n}" width="${W}" height="${H}">${grid}
    <line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" class="axis"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" class="axis"/>
    ${body}<text x="${W / 2 - 25}" y="${H - 4}">${ax.label}</text></svg></div>`;
}

function histogram(id, title, hist) {
  const keys = Object.keys(hist || {}).sort((a, b) => a - b);
  const W = 400, H = 190, L = 46, B = 34, T = 10;
  if (!keys.length) return chart(id, title, [], null);
  const total = keys.reduce((a, k) => a + hist[k], 0), top = Math.max(...keys.map(k => hist[k]));
  const bw = (W - L - 10) / keys.length;
  let bars = "";
  keys.forEach((k, i) => {
    const h = (H - T - B - 12) * hist[k] / top, x = L + i * bw;
    bars += `<rect x="${(x + 2).toFixed(1)}" y="${(H - B - h).toFixed(1)}" width="${Math.max(bw - 4, 1).toFixed(1)}" height="${h.toFixed(1)}" fill="#8250df"/>
      <text x="${(x + bw / 2 - 6).toFixed(1)}" y="${H - B + 13}">${esc(k)}</text>
      <text x="${(x + bw / 2 - 12).toFixed(1)}" y="${(H - B - h - 3).toFixed(1)}">${(100 * hist[k] / total).toFixed(1)}%</text>`;
  });
  return `<div class="card"><b>${esc(title)}</b><div class="legend">${fmt(total)} trained samples by versions behind the trainer</div>
    <svg data-chart="${id}" data-points="${keys.length}" width="${W}" height="${H}">${bars}
    <line x1="${L}" y1="${H - B}" x2="${W - 10}" y2="${H - B}" class="axis"/>
    <text x="${W / 2 - 45}" y="${H - 4}">staleness (versions)</text></svg></div>`;
}

function table(el, obj) {
  $(el).innerHTML = Object.entries(obj || {}).filter(([, v]) => v !== undefined)
    .map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(isNum(v) ? fmt(v) : v == null ? "–" : v)}</td></tr>`).join("");
}

function panels(s) {
  const c = s.charts || {}, v = c.versions || {}, sum = s.summary || {}, act = c.activity || {};
  const state = s.state || (sum.steps ? "finished" : s.trainer_done ? "trainer done" : "running");
  $("state").textContent = state; $("state").className = "state " + state;
  table("run", {run_id: s.run_id, algorithm: s.config.algorithm, model: s.config.model, dataset: s.config.dataset,
                reward: s.config.reward, steps: s.config.steps, phases: s.config.phases,
                "replay epochs": s.config.replay_epochs, sampler: s.config.sampler_backend,
                stopped: s.stopped ? "yes" : "no", "trainer done": s.trainer_done ? "yes" : "no"});
  const tr = (c.streams || {}).trainer || {x: []};
  table("summary", s.summary ? {
    "held-out before → after": `${fmt(sum.eval_before)} → ${fmt(sum.eval_after)}`,
    "reward first → last": `${fmt(sum.reward_first)} → ${fmt(sum.reward_last)}`,
    steps: sum.steps, "samples trained / generated": `${fmt(sum.samples_trained)} / ${fmt(sum.samples_generated)}`,
    "wall time": isNum(sum.wall_s) ? dur(sum.wall_s) : null,
    "sampler / trainer busy": `${fmt(sum.sampler_busy_s)}s / ${fmt(sum.trainer_busy_s)}s`,
    "overlap": isNum(sum.overlap_s) ? sum.overlap_s + "s" : null, "max staleness": sum.max_staleness_seen,
  } : {status: "not written yet (finalize writes it)", "trainer step": tr.x.length ? tr.x[tr.x.length - 1] : "–",
       "overlap so far": isNum(act.overlap_s) ? act.overlap_s + "s" : "–"});
  table("policy", {latest: v.latest != null ? "v" + v.latest : "–", published: v.published,
                   "on storage": `${v.stored} (${v.stored_ranges || "–"})`,
                   "loaded by samplers": v.sampler_loaded ? `${v.sampler_loaded}, newest v${v.sampler_newest}` : "–"});
  const tiers = (s.buffer || {}).tiers || {};
  $("buffer").innerHTML = "<tr><th></th><th>rows</th><th>groups</th><th>shards</th></tr>" + ["l1", "l2", "l3"].map(t =>
    `<tr><th>${t.toUpperCase()}</th><td>${fmt((tiers[t] || {}).rows)}</td><td>${fmt((tiers[t] || {}).groups)}</td><td>${fmt((tiers[t] || {}).shards)}</td></tr>`).join("")
    + `<tr><th>L2 eligible</th><td colspan="3">${fmt((s.buffer || {}).l2_eligible_groups)} groups</td></tr>`;
  $("phases").innerHTML = (s.phases || []).map(p =>
    `<tr><th>${p.kind === "phase" ? "phase" : "replay gate"} ${p.index}</th><td class="${p.done ? "ok" : "wait"}">${p.done ? (p.kind === "phase" ? "done" : "open") : "waiting"}</td>
     <td>${p.step != null ? "step " + esc(p.step) : p.eligible != null ? esc(p.eligible) + " eligible groups" : ""}</td></tr>`).join("");
}

function charts(s) {
  const ax = axisOf(s), c = s.charts || {}, st = c.streams || {}, tr = st.trainer;
  const samplers = Object.keys(st).filter(k => k.startsWith("sampler")).sort();
  const ev = {events: c.events || []};
  const out = [];
  out.push(chart("reward", "Reward", [streamSeries(ax, tr, "reward/mean", "trainer batch mean", COLORS[0], true),
    ...samplers.map((k, i) => streamSeries(ax, st[k], "reward/mean", k + " batch mean", COLORS[3 + i % 3], false))], ax, ev));
  const evals = ((s.curves || {}).eval || {})["eval/score"] || [];
  out.push(chart("heldout", "Held-out score by policy version", [{name: "held-out score (greedy, unseen prompts)", kind: "points",
    xs: evals.map(p => ax.fromStep(p[0])), ys: evals.map(p => p[1]), color: COLORS[2]}], ax,
    {...ev, empty: "evaluated by finalize (v0 and the final policy)"}));
  out.push(chart("kl", "KL and log-prob gap", [streamSeries(ax, tr, "actor/kl", "k3 KL to the initial policy", COLORS[0], true),
    streamSeries(ax, tr, "actor/behavior_shift", "behaviour → current policy shift", COLORS[1], true),
    streamSeries(ax, tr, "actor/logprob_gap", "sampler vs trainer log-prob gap", COLORS[2], true)], ax, ev));
  out.push(chart("clip", "Clip fraction", [streamSeries(ax, tr, "actor/clip_frac", "ratio clipped", COLORS[0], true),
    streamSeries(ax, tr, "is/clip_frac", "IS weight truncated", COLORS[1], true)], ax, {...ev, zero: true}));
  out.push(chart("is", "Importance-sampling weights", [streamSeries(ax, tr, "is/weight_mean", "mean", COLORS[0], true),
    streamSeries(ax, tr, "is/weight_max", "max", COLORS[1], true)], ax, ev));
  out.push(histogram("staleness_hist", "Staleness of trained samples", c.staleness_hist));
  out.push(chart("staleness", "Staleness over the run", [streamSeries(ax, tr, "staleness/mean", "mean", COLORS[0], true),
    streamSeries(ax, tr, "staleness/max", "max", COLORS[1], true)], ax, {...ev, zero: true}));
  out.push(chart("throughput", "Throughput (tokens/s)", [streamSeries(ax, tr, "perf/tokens_per_s", "trainer", COLORS[0], true),
    ...samplers.map((k, i) => streamSeries(ax, st[k], "perf/gen_tokens_per_s", k + " generated", COLORS[3 + i % 3], false))], ax, {...ev, zero: true}));
  const act = c.activity || {}, at = (act.t || []).map(ax.fromTime);
  out.push(chart("overlap", `Sampler and trainer busy (overlap ${isNum(act.overlap_s) ? act.overlap_s + "s" : "–"})`, [
    {name: "trainer", xs: at, ys: act.trainer || [], color: COLORS[0], smooth: true},
    {name: "sampler", xs: at, ys: act.sampler || [], color: COLORS[3], smooth: true},
    {name: "both at once", xs: at, ys: act.overlap || [], color: COLORS[2], smooth: true}], ax, {...ev, zero: true, ymax: 1}));
  const bh = c.buffer_history || {t: []}, bt = (bh.t || []).map(ax.fromTime);
  out.push(chart("buffer", "Buffer tiers (rows)", ["l1", "l2", "l3"].map((k, i) =>
    ({name: k.toUpperCase(), xs: bt, ys: bh[k] || [], color: COLORS[i], smooth: false})), ax, {...ev, zero: true, raw: true}));
  out.push(chart("versions", "Policy versions: trainer vs samplers", [
    tr && {name: "trainer step (newest version)", xs: ui.axis === "step" ? tr.x : tr.t.map(ax.fromTime), ys: tr.x, color: COLORS[0]},
    ...samplers.map((k, i) => streamSeries(ax, st[k], "sampler/policy_version", k + " generating with", COLORS[3 + i % 3], false))],
    ax, {...ev, raw: true}));
  out.push(chart("loss", "Loss and entropy", [streamSeries(ax, tr, "actor/loss", "loss", COLORS[0], true),
    streamSeries(ax, tr, "actor/entropy", "entropy", COLORS[1], true)], ax, ev));
  $("charts").innerHTML = out.join("");
}

function render() {
  if (!last) return;
  try { panels(last); charts(last); $("err").textContent = ""; }
  catch (e) { $("err").textContent = "drawing failed: " + e; throw e; }
}

async function refresh() {
  try {
    const r = await fetch(STATUS_URL, {credentials: "same-origin"});
    if (!r.ok) {
      const detail = await r.json().then(b => b.detail, () => "");
      $("err").textContent = `status: HTTP ${r.status} ${detail || ""}`;
      schedule(); return;
    }
    last = await r.json();
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    render();
    if (TERMINAL.has(last.state)) { $("updated").textContent += " · run " + last.state + ": no more polling"; return; }
  } catch (e) { $("err").textContent = String(e); }
  schedule();
}
function schedule() { clearTimeout(timer); timer = setTimeout(refresh, 5000); }

document.addEventListener("DOMContentLoaded", () => {
  $("axis").addEventListener("change", e => { ui.axis = e.target.value; render(); });
  $("smooth").addEventListener("change", e => { ui.smooth = e.target.checked; render(); });
  $("alpha").addEventListener("input", e => { ui.alpha = +e.target.value; $("alphav").textContent = ui.alpha.toFixed(2); render(); });
  refresh();
});
