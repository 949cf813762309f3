"""The planner's page (`lit3d.planner.explore`): one self-contained HTML file, its numbers embedded as JSON and its
script only selecting and drawing them. Nothing is loaded from elsewhere: it opens from a file, offline, and in a
notebook's frame.

NOTE: the script is written here rather than with a front-end library, because a page that must work offline from one
file cannot load one, and the drawing is a grid of boxes and a table: a hundred lines of plain DOM code.
"""

from __future__ import annotations

import html
import json
from typing import Any

STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#555;margin-bottom:10px}
#controls{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:8px}
#controls label{display:flex;gap:6px;align-items:center}
#summary{font-weight:600;margin:6px 0} #status.bad{color:#b00020} #status.good{color:#1b5e20}
#main{display:flex;gap:16px;align-items:flex-start}
#grid{display:flex;flex-wrap:wrap;gap:6px;max-width:760px}
.node{border:1px solid #999;border-radius:4px;padding:3px;display:grid;gap:2px}
.node .name{grid-column:1/-1;font-size:10px;color:#555}
.gpu{height:34px;border-radius:3px;font-size:9px;line-height:11px;text-align:center;cursor:pointer;
     border:2px solid transparent;padding-top:2px;box-sizing:border-box}
#grid.compact .gpu{height:12px;font-size:0;padding:0;border-width:1px} #grid.compact .node .name{font-size:8px}
.gpu.over{background-image:repeating-linear-gradient(45deg,transparent 0 4px,rgba(176,0,32,.35) 4px 6px)}
.gpu.sel{border-color:#000} .gpu.tp{border-color:#e65100} .gpu.dp{border-color:#1565c0}
.gpu.pp{border-color:#2e7d32} .gpu.cp{border-color:#6a1b9a} .gpu.ep{border-color:#ad1457}
#side{min-width:300px} table{border-collapse:collapse} td,th{padding:2px 8px;text-align:right}
td:first-child,th:first-child{text-align:left} #ranking li{cursor:pointer;text-decoration:underline;margin:2px 0}
.more{color:#555;font-size:12px}
"""

SCRIPT = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const S = {d: 1, t: D.axes.t[0], p: D.axes.p[0], ep: 1, cp: 1, zero: 1, rank: 0};
const AXES = ['tp', 'cp', 'dp', 'pp', 'ep'];
const gb = b => (b / 1e9).toFixed(2) + ' GB';
const $ = id => document.getElementById(id);
function dValues() { const n = D.cluster.gpus / (S.t * S.p * S.cp), v = [];
  for (let k = 1; k <= n; k++) if (n % k === 0) v.push(k); return v; }
function key() { return [S.d, S.t, S.p, S.ep, S.cp, S.zero].join(','); }
function slider(name, values) {
  const el = $(name); el.max = values.length - 1; el.value = Math.max(0, values.indexOf(S[name]));
  $(name + 'v').textContent = S[name];
}
function clampD() { const v = dValues(); if (!v.includes(S.d)) S.d = Math.max(...v.filter(x => x <= S.d), 1); }
function coords(r) { const T = S.t, C = S.cp, Dd = S.d;
  return {t: r % T, c: Math.floor(r / T) % C, d: Math.floor(r / (T * C)) % Dd, p: Math.floor(r / (T * C * Dd))}; }
function where(c) {  // a GPU's coordinates; e: its share of each MoE layer's experts, in its expert-parallel group
  return 't' + c.t + ' p' + c.p + (S.cp > 1 ? ' c' + c.c : '') + ' d' + c.d + (S.ep > 1 ? ' e' + c.d % S.ep : ''); }
function sameGroup(axis, a, b) {
  if (axis === 'tp') return a.d === b.d && a.c === b.c && a.p === b.p;
  const shard = (D.layouts[key()] || {}).shard;  // HSDP: the dp group shown is the rank's shard group
  if (axis === 'dp') return a.t === b.t && a.c === b.c && a.p === b.p &&
    (!shard || Math.floor(a.d / shard) === Math.floor(b.d / shard));
  if (axis === 'pp') return a.t === b.t && a.c === b.c && a.d === b.d;
  if (axis === 'cp') return a.t === b.t && a.d === b.d && a.p === b.p;
  return a.t === b.t && a.c === b.c && a.p === b.p && Math.floor(a.d / S.ep) === Math.floor(b.d / S.ep);
}
function draw() {
  clampD(); ['t', 'p', 'ep', 'cp'].forEach(n => slider(n, D.axes[n])); slider('d', dValues());
  const n = S.d * S.t * S.p * S.cp, per = D.cluster.gpus_per_node, st = $('status');
  const e = D.layouts[key()] || {error: 't x p x cp = ' + S.t * S.p * S.cp + ' GPUs, more than the cluster has'};
  if (S.rank >= n) S.rank = 0;
  $('total').textContent = n; $('grids').textContent = S.d * S.cp;
  if (!D.layouts[key()]) {
    st.textContent = 'cannot run: ' + e.error; st.className = 'bad';
    $('grid').textContent = ''; $('panel').textContent = ''; return;
  }
  if (e.error) {
    st.textContent = (e.fits === false ? 'does not fit: ' : 'cannot run: ') + e.error; st.className = 'bad';
  } else { st.textContent = 'step ' + e.step_s.toFixed(3) + ' s, MFU ' + (100 * e.mfu).toFixed(1) + '%, bubble ' +
         (100 * e.bubble).toFixed(1) + '%, ' + e.microbatches + ' micro-batches per schedule'; st.className = 'good'; }
  const grid = $('grid'), compact = n > 128, width = compact ? 12 : 48;  // many GPUs: small cells, no text
  grid.textContent = ''; grid.classList.toggle('compact', compact);
  const sel = coords(S.rank), on = AXES.filter(a => $('show-' + a).checked);
  for (let node = 0; node * per < n; node++) {
    const box = document.createElement('div'); box.className = 'node';
    box.style.gridTemplateColumns = 'repeat(' + Math.min(per, 8) + ',' + width + 'px)';
    box.innerHTML = '<div class="name">node ' + node + '</div>'; grid.appendChild(box);
    for (let r = node * per; r < Math.min(n, (node + 1) * per); r++) {
      const c = coords(r), cell = document.createElement('div'); cell.className = 'gpu';
      cell.dataset.rank = r; cell.style.background = 'hsl(' + (c.p * 137.5 % 360) + ',60%,78%)';
      cell.title = 'GPU ' + r + ': ' + where(c) + (S.ep > 1 ? ', expert group ' + Math.floor(c.d / S.ep) : '');
      cell.textContent = where(c);
      if (e.stages) { const row = D.rows[e.stages[c.p]], total = row[D.components.indexOf('total')];
        cell.appendChild(document.createElement('br')); cell.append(gb(total));
        if (total > D.training.usable_gb * 1e9) cell.classList.add('over'); }
      for (const a of on) if (sameGroup(a, c, sel)) cell.classList.add(a);
      if (r === S.rank) cell.classList.add('sel');
      cell.onclick = () => { S.rank = r; draw(); };
      box.appendChild(cell);
    }
  }
  panel(e, sel);
}
function panel(e, c) {
  const p = $('panel');
  let h = '<b>GPU ' + S.rank + '</b> (' + where(c) + ', node ' + Math.floor(S.rank / D.cluster.gpus_per_node) + ')';
  if (S.ep > 1) h += '<br>expert group ' + Math.floor(c.d / S.ep) + ': ' + S.ep + ' GPUs (d ' +
    Math.floor(c.d / S.ep) * S.ep + '-' + (Math.floor(c.d / S.ep) * S.ep + S.ep - 1) + '), each holding 1/' + S.ep +
    ' of every MoE layer\'s experts';
  if (e.shard) h += '<br>HSDP shard group ' + Math.floor(c.d / e.shard) + ' of ' + S.d / e.shard + ': ZeRO over ' +
    e.shard + ' data-parallel ranks (d ' + Math.floor(c.d / e.shard) * e.shard + '-' +
    (Math.floor(c.d / e.shard) * e.shard + e.shard - 1) + '); the groups all-reduce their shards once per step';
  if (e.rejoin) h += '<br>replica group 0 of ' + D.replica_groups + ': a group that rejoins loads <span id="rejoin" ' +
    'data-bytes="' + e.rejoin + '">' + gb(e.rejoin) + '</span> into this GPU from a live one (weights and ' +
    'optimizer state), once';
  if (!e.stages) { p.innerHTML = h; const why = document.createElement('p'); why.textContent = e.error;
    p.appendChild(why); return; }
  const row = D.rows[e.stages[c.p]];
  h += '<table><tr><th>holds</th><th>GB</th></tr>';
  D.components.forEach((name, i) => { if (row[i] || name === 'total')
    h += '<tr><td>' + name + '</td><td data-bytes="' + row[i] + '" id="mem-' + name + '">' + gb(row[i]) +
         '</td></tr>'; });
  h += '</table><table><tr><th>sends per step</th><th>GB</th><th>s</th><th>link GB/s</th></tr>';
  for (const [axis, v] of Object.entries(e.comm)) h += '<tr><td>' + axis + '</td><td data-bytes="' + v[0] +
    '" id="comm-' + axis + '">' + (v[0] / 1e9).toFixed(2) + '</td><td>' + v[1].toFixed(3) + '</td><td>' + v[2] +
    '</td></tr>';
  p.innerHTML = h + '</table>';
}
function ranking() {
  const ol = $('ranking');
  D.ranking.forEach(k => { const e = D.layouts[k], [d, t, p, ep, cp, zero] = k.split(',').map(Number);
    const li = document.createElement('li'); li.dataset.key = k;
    li.textContent = 'dp' + d + ' tp' + t + ' pp' + p + (ep > 1 ? ' ep' + ep : '') + (cp > 1 ? ' cp' + cp : '') +
      ' ZeRO-' + zero + ': ' + e.step_s.toFixed(3) + ' s, ' + gb(e.memory);
    li.onclick = () => { Object.assign(S, {d, t, p, ep, cp, zero, rank: 0}); $('zero').value = zero; draw(); };
    ol.appendChild(li); });
}
['t', 'p', 'ep', 'cp'].forEach(n => $(n).oninput = ev => { S[n] = D.axes[n][ev.target.value]; draw(); });
$('d').oninput = ev => { S.d = dValues()[ev.target.value]; draw(); };
$('zero').onchange = ev => { S.zero = Number(ev.target.value); draw(); };
AXES.forEach(a => $('show-' + a).onchange = draw);
if (D.ranking.length) { const [d, t, p, ep, cp, zero] = D.ranking[0].split(',').map(Number);
  Object.assign(S, {d, t, p, ep, cp, zero}); }
$('zero').value = S.zero; ranking(); draw();
"""


# Nothing from elsewhere, even by mistake: the page's own style and script only.
POLICY = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def _slider(name: str, label: str, hidden: bool = False) -> str:
    style = ' style="display:none"' if hidden else ""
    control = f'<input type="range" id="{name}" min="0" max="0" step="1"><span id="{name}v"></span>'
    return f"<label{style}>{label} {control}</label>"


def render(data: dict[str, Any]) -> str:
    """The page of `lit3d.planner.explore.page_data`'s ``data``: one HTML document, nothing fetched."""
    model, cluster, training = data["model"], data["cluster"], data["training"]
    title = f"lit3d plan: {model['name']} on {cluster['nodes']} x {cluster['gpus_per_node']} {cluster['gpu']}"
    sub = (
        f"{model['params'] / 1e9:.1f}B parameters, {model['n_layer']} blocks; global batch "
        f"{training['global_batch_size']} x {training['seq_len']} tokens, micro-batch {training['micro_batch_size']}"
        f", {training['precision']}, pipelines {training['pipeline_schedule']}; "
        f"{training['usable_gb']:.1f} GB usable per GPU"
    )
    groups = data.get("replica_groups", 1)
    if groups > 1:
        sub += (
            f"; {groups} replica groups (torchft), each this layout on nodes of its own (REPLICA_GROUP_ID 0-"
            f"{groups - 1}), averaging gradients each step: group 0's shown"
        )
    axes = data["axes"]
    sliders = "".join(
        [
            _slider("d", "data parallel d"),
            _slider("t", "tensor parallel t"),
            _slider("p", "pipeline parallel p"),
            _slider("ep", "expert parallel", len(axes["ep"]) < 2),
            _slider("cp", "context parallel", len(axes["cp"]) < 2),
        ]
    )
    zero = "".join(f'<option value="{z}">ZeRO-{z}</option>' for z in data["axes"]["zero"])
    toggles = "".join(
        f'<label><input type="checkbox" id="show-{a}">{a.upper()} group</label>' for a in ("tp", "cp", "dp", "pp", "ep")
    )
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta http-equiv="Content-Security-Policy" content="{POLICY}">
<style>{STYLE}</style></head><body>
<h1>{html.escape(title)}</h1><div class="sub">{html.escape(sub)}</div>
<div id="controls">{sliders}<label>optimizer state <select id="zero">{zero}</select></label>{toggles}</div>
<div id="summary">d x t x p{" x cp" if len(axes["cp"]) > 1 else ""} = <span id="total"></span> GPUs of
 {cluster["gpus"]}, <span id="grids"></span> grid(s) of t x p: <span id="status"></span></div>
<div id="main"><div id="grid"></div><div id="side"><div id="panel"></div>
<h3>fastest layouts that fit</h3><ol id="ranking"></ol>
<div class="more">Each cell is one GPU: t, p, d its coordinates (with expert parallelism, e: its share of the experts
in its group of consecutive d; colour: pipeline stage), and what its stage holds at
the step's peak (hatched: more than usable; past 128 GPUs the cells are small, their coordinates in a tooltip).
Click a GPU for what it holds and sends; tick a group to outline it.</div>
</div></div>
<script type="application/json" id="data">{payload}</script>
<script>{SCRIPT}</script></body></html>
"""
