"""
relay_dashboard: `python relay.py dashboard STORE_OR_RUN_DIR` serves one read-only page of a relay run (or a local
train.py out_dir): loss and val loss against tokens, tokens/s, MFU, expert load balance per layer, the baton, the
ledger. The data is inlined in the page (works offline, no CDN) and refreshed from /data.json; every value from
the store is escaped before it reaches the HTML. Given a relay workdir, the curves are its pushed legs' steps (up to
each push); the leg its lease trains now is a "not pushed" loss series of its own; a fenced, failed or set-aside leg
is left out, and named. Each step is shown once, as the newest leg that logged it logged it (one_row_per_step).
"""

import html
import io
import json
import math
import os
import re
import threading
import time

import relay
import relay_store

# bytes of leg logs (as stored) the dashboard reads and keeps, newest leg first: each log is capped on its own
# (relay_store.READ_CAPS), but a run's logs add up, one per leg, without bound; the older ones are named, not read
LOG_BUDGET = 128 * relay_store.MiB
# a metrics row's keys the page reads (render(): charts, heatmap, the local run's step, tokens and $; and
# load_collapsed, kept when true: the banner's); the rest of a train.py row (per-layer dead fractions, gpu, time, ...)
# is dropped as the log is read
SHOWN_KEYS = ("step", "tokens", "loss", "val_loss", "lr", "tok_per_s", "mfu", "dead_frac", "load_cv", "load_cv_layers",
              "usd")


def dashboard_data(target, log_cache=None):
    """Everything the page shows, from a store URL or a local run dir (metrics.jsonl only). log_cache keeps the
    parsed logs/leg-N.jsonl between refreshes, by name and content id (a name comes back after a revert)."""
    d = {"source": target, "generated_at": time.time(), "metrics": [], "ledger": [], "baton": None, "state": None}
    log_cache = {} if log_cache is None else log_cache
    if "://" in target:
        store = relay.open_store(target)
        st = relay.status_dict(store)
        d["baton"] = {k: st[k] for k in ("holder", "expired_holder", "generation", "leg", "claimed_at", "lease_age_s", "ttl_s")}
        d["state"] = {k: st[k] for k in ("step", "tokens", "stage", "legs", "decay_requested", "decay", "usd_total",
                                         "last_eval_due")}
        d["ledger"] = st["ledger"]
        d["left_out"] = []
        # keyed by content, not name: a push reverted on the Hub gives the next leg the same logs/leg-NNNN.jsonl
        ids = store.file_ids(st["head"], "logs/")
        held, older, logs = 0, [], []  # bytes of log counted so far, newest leg first; the logs past LOG_BUDGET
        for p in sorted((p for p in ids if p.endswith(".jsonl")), key=lambda p: (len(p), p), reverse=True):
            key = (p, ids[p])  # (leg-10000 sorts after leg-9999: by length, then name)
            if key not in log_cache or log_cache[key][1] is None and held + log_cache[key][0] <= LOG_BUDGET:
                if held > LOG_BUDGET:  # past it: not read at all
                    older.append(p)
                    continue
                data = store.read(st["head"], p) or b""
                log_cache[key] = (len(data), None if held + len(data) > LOG_BUDGET else shown_rows(data))
                del data  # (the log's bytes: not held beside its rows while the next one is read)
            size, rows = log_cache[key]
            held += size
            if held > LOG_BUDGET:  # its rows dropped, its size kept: not read again at every refresh
                log_cache[key] = (size, None)
                older.append(p)
                continue
            logs.append(rows)
        d["metrics"] = one_row_per_step(logs)
        if older:
            which = older[0] if len(older) == 1 else f"{len(older)} older leg logs, {older[-1]} to {older[0]}"
            d["left_out"].append(f"{which} (the dashboard reads at most {relay_store.fmt_bytes(LOG_BUDGET)} of leg "
                                 f"logs, newest first)")
        for gone in [k for k in log_cache if ids.get(k[0]) != k[1]]:  # a reverted leg's log: not kept for months
            del log_cache[gone]
    else:
        if not os.path.isdir(target):
            raise relay.RelayError(f"{target}: not a store URL nor a run directory; pass hf://owner/name, file:///path or a train.py out_dir")
        # (leg, generation) of each log: a train.py out_dir's own metrics.jsonl is older than any leg dir in it
        logs = [((-1, -1), relay.read_metrics(os.path.join(target, "metrics.jsonl")))]
        d["left_out"] = []
        lease = relay_lease_record(target)
        for name in sorted(n for n in os.listdir(target) if n.startswith("leg-")):
            rows, why = leg_history(os.path.join(target, name), lease)
            number = re.match(r"leg-(\d+)-gen(\d+)", name)  # (by number: leg-10000 sorts before leg-9999 by name)
            logs.append((tuple(map(int, number.groups())) if number else (-1, -1), rows))
            if why:
                d["left_out"].append(f"{name} ({why})")
        d["metrics"] = one_row_per_step([m for m in map(shown_metric, rows) if m is not None]
                                        for _, rows in sorted(logs, key=lambda log: log[0], reverse=True))
    d["metrics"].sort(key=lambda m: (m.get("tokens") or 0, m.get("step") or 0))  # (newest leg first above)
    if d["state"] is None:  # a run directory: its newest row's (sorted, not the oldest leg's last)
        usd = [m["usd"] for m in d["metrics"] if isinstance(m.get("usd"), (int, float))]
        d["state"] = {"step": d["metrics"][-1].get("step") if d["metrics"] else None,
                      "tokens": d["metrics"][-1].get("tokens") if d["metrics"] else None, "usd_total": usd[-1] if usd else 0.0}
    d["load_collapse"] = load_collapse(d["metrics"])
    return d


def load_collapse(rows):
    """The banner's figures when the newest row says its trainer warned of an expert-load collapse (train.py's
    load_collapsed, said once in that trainer's log): {"step": that row's, "since": the first of the rows before it
    that all say so}; else None."""
    if not rows or rows[-1].get("load_collapsed") is not True:
        return None
    since = len(rows) - 1
    while since > 0 and rows[since - 1].get("load_collapsed") is True:
        since -= 1
    return {"step": rows[-1].get("step"), "since": rows[since].get("step")}


def one_row_per_step(logs):
    """The rows of logs (each leg's, newest leg first), each step's from the newest leg that logged it: a leg that
    measured the val loss of the step it pulled (its evaluation cut short by a stop signal) logs that step again, with
    the val loss, and the leg before logged it without (two points at one step, one missing it). A crashed leg's steps
    past its last checkpoint, which the next leg redoes, are already left out (push logs up to the step it pushes;
    leg_history up to PUSHED). A row of this workdir's leg not pushed yet is its own series: it hides no row."""
    seen, out = set(), []
    for rows in logs:
        out += [m for m in rows if m.get("not_pushed") or m.get("step") is None or m["step"] not in seen]
        seen.update(m.get("step") for m in rows if not m.get("not_pushed"))
    return out


def relay_lease_record(workdir):
    """The lease a relay workdir holds now (its LEASE.json as a dict), or None."""
    try:
        rec = json.load(open(os.path.join(workdir, "LEASE.json")))
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def leg_history(leg_dir, lease):
    """The metrics of a relay workdir's leg dir that are the run's history, and why the rest is left out (or None).
    A pushed leg's steps up to its push (PUSHED) count; the leg this workdir's lease trains now is shown marked
    not_pushed; a fenced or failed leg (never pushed, its lease gone), steps trained after a push, and a leg dir set
    aside (.other-*: another lease's) were plotted as if the run had trained them, over the steps it did train."""
    name = os.path.basename(leg_dir)
    if not re.fullmatch(r"leg-\d+-gen\d+", name):
        return [], "set aside: another lease's leg" if ".other-" in name else "not a leg dir's name"
    rows = relay.read_metrics(os.path.join(leg_dir, "metrics.jsonl"))
    owned = {os.path.abspath(str(lease[k])) for k in ("run_dir", "push_dir") if lease and lease.get(k)}
    current = os.path.abspath(leg_dir) in owned and (relay.leg_owner(leg_dir) or (None, None))[1] == lease.get("nonce")
    try:
        parts = open(os.path.join(leg_dir, "PUSHED")).read().split()
        pushed = int(parts[1]) if len(parts) > 1 else math.inf  # (an older relay.py's marker: no step)
    except (OSError, ValueError):
        pushed = None
    if pushed is None and not current:
        return [], "never pushed: a lost lease's or a failed leg's" if rows else None
    history, later = [], []
    for m in rows:
        step = m.get("step")
        pushed_step = pushed is not None and isinstance(step, (int, float)) and step <= pushed
        (history if pushed_step else later).append(m)
    if current:
        return history + [dict(m, not_pushed=True) for m in later], None
    return history, "steps after its push, never pushed" if later else None


def shown_rows(data):
    """A leg log's bytes as the rows the page shows (shown_metric), malformed lines left out."""
    lines = (line.decode(errors="replace") for line in io.BytesIO(data))  # (one line at a time: no copy of the log)
    same = {}  # one float object per value in the per-layer lists (rounded to 4 places: a few thousand values)
    rows = (shown_metric(m, same) for m in map(safe_json, lines) if m)
    return [m for m in rows if m is not None]


def shown_metric(m, same=None):
    """A metrics row as the page shows it, or None: only SHOWN_KEYS (a train.py row holds ~20 keys and per-layer lists
    the page never reads: 128 MiB of logs held ~1 GiB parsed), numbers only; step and tokens numbers (a string there
    crashed the sort, so the server); NaN / Infinity as null (json.dumps wrote NaN, which the page's refresh could not
    parse: it froze, silently)."""
    for key in ("step", "tokens"):
        v = m.get(key)
        if v is not None and (not shown_number(v) or finite(v) is None):
            return None
    out = {}
    for k in SHOWN_KEYS:
        v = m.get(k)
        if shown_number(v) or v is None and k in m:
            out[k] = finite(v)
        elif isinstance(v, list) and all(x is None or shown_number(x) for x in v):
            out[k] = [finite(x) for x in v] if same is None else [same.setdefault(x, x) for x in map(finite, v)]
    if m.get("load_collapsed") is True:  # (train.py's: its expert load collapsed; the banner's, false left out)
        out["load_collapsed"] = True
    if m.get("not_pushed") is True:  # (leg_history's mark: this workdir's leg, not pushed yet)
        out["not_pushed"] = True
    return out


def shown_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v  # (an int is: 10**400 has no float)


def safe_json(line):
    try:
        m = json.loads(line)
        return m if isinstance(m, dict) else None
    except (ValueError, RecursionError):  # (RecursionError: a line of [[[[... a hostile leg log pushed)
        return None


PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>picaflor relay: __TITLE__</title>
<style>
body{font:14px system-ui,sans-serif;margin:20px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
.kv span{display:inline-block;margin-right:18px} .kv b{font-weight:600}
table{border-collapse:collapse;font-size:12px;width:100%} td,th{border-bottom:1px solid #eee;padding:3px 6px;text-align:right}
td:nth-child(2),td:nth-child(3),th:nth-child(2),th:nth-child(3){text-align:left}
svg text{font-size:10px;fill:#555} .muted{color:#888} .warn{border-color:#d62728;color:#a00;font-weight:600}
</style></head><body>
<h1>picaflor relay &mdash; <span id="src"></span></h1>
<div class="muted" id="updated"></div>
<div class="card warn" id="collapse" hidden></div>
<div class="card kv" id="baton"></div>
<div class="grid">
 <div class="card"><h2>Loss over tokens</h2><svg id="loss" width="440" height="230"></svg></div>
 <div class="card"><h2>Throughput (tokens/s)</h2><svg id="tps" width="440" height="230"></svg></div>
 <div class="card"><h2>MFU (share of the GPU's dense bf16 peak; none on CPU)</h2><svg id="mfu" width="440" height="230"></svg></div>
 <div class="card"><h2>Learning rate</h2><svg id="lr" width="440" height="230"></svg></div>
 <div class="card"><h2>Dead-expert fraction</h2><svg id="dead" width="440" height="230"></svg></div>
 <div class="card"><h2>Expert balance: load CV per MoE layer (green = even)</h2><svg id="heat" width="440" height="230"></svg></div>
</div>
<div class="card"><h2>Ledger</h2><div id="ledger"></div></div>
<script>
var DATA = __DATA__;
var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
function el(tag, attrs, text) { var e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; }
function fmt(v) { if (v === null || v === undefined) return "-"; if (typeof v !== "number") return esc(v); var a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(2) + "B"; if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k"; if (a > 0 && a < 0.01) return v.toExponential(1); return (+v.toFixed(4)).toString(); }
function mean(x) { return Array.isArray(x) ? (x.length ? x.reduce(function (a, b) { return a + b; }, 0) / x.length : null) : x; }
function num(v) { return typeof v === "number" && isFinite(v); }
// series: [{name, pts:[[x,y],...]}]; draws axes, 4 ticks each, polylines, legend; "no data" when empty
function lineChart(id, series, xlabel) {
  var svg = document.getElementById(id); while (svg.firstChild) svg.removeChild(svg.firstChild);
  var W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 54, R = 10, T = 10, B = 34;
  var all = []; series.forEach(function (s) { all = all.concat(s.pts); });
  if (!all.length) { svg.appendChild(el("text", {x: W / 2 - 20, y: H / 2, "class": "nodata"}, "no data")); return; }
  var x0 = Math.min.apply(null, all.map(function (p) { return p[0]; })), x1 = Math.max.apply(null, all.map(function (p) { return p[0]; }));
  var y0 = Math.min.apply(null, all.map(function (p) { return p[1]; })), y1 = Math.max.apply(null, all.map(function (p) { return p[1]; }));
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y1 = y0 + Math.abs(y0 || 1) * 0.1; y0 = y0 - Math.abs(y0 || 1) * 0.1; }
  var sx = function (x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }, sy = function (y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  svg.appendChild(el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
  svg.appendChild(el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
  for (var i = 0; i <= 4; i++) {
    var xv = x0 + (x1 - x0) * i / 4, yv = y0 + (y1 - y0) * i / 4;
    svg.appendChild(el("text", {x: sx(xv), y: H - B + 13, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle"}, fmt(xv)));
    svg.appendChild(el("text", {x: 2, y: sy(yv) + 3}, fmt(yv)));
    svg.appendChild(el("line", {x1: L, y1: sy(yv), x2: W - R, y2: sy(yv), stroke: "#eee"}));
  }
  svg.appendChild(el("text", {x: W / 2 - 20, y: H - 4}, xlabel));
  series.forEach(function (s, k) {
    if (!s.pts.length) return;
    var d = s.pts.map(function (p) { return sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); }).join(" ");
    svg.appendChild(el("polyline", {points: d, fill: "none", stroke: COLORS[k % 4], "stroke-width": 1.5, "class": "series", "data-name": s.name}));
    if (s.pts.length === 1) svg.appendChild(el("circle", {cx: sx(s.pts[0][0]), cy: sy(s.pts[0][1]), r: 3, fill: COLORS[k % 4]}));
    svg.appendChild(el("text", {x: W - R - 90, y: T + 12 + 12 * k, style: "fill:" + COLORS[k % 4]}, s.name));
  });
}
function heatmap(id, rows) { // rows: [{x, vals:[per layer]}]
  var svg = document.getElementById(id); while (svg.firstChild) svg.removeChild(svg.firstChild);
  var W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), L = 54, B = 34, T = 10, R = 40;
  if (!rows.length) { svg.appendChild(el("text", {x: W / 2 - 20, y: H / 2, "class": "nodata"}, "no data")); return; }
  var nl = Math.max.apply(null, rows.map(function (r) { return r.vals.length; }));
  var vmax = 0; rows.forEach(function (r) { r.vals.forEach(function (v) { if (num(v)) vmax = Math.max(vmax, v); }); });
  vmax = vmax || 1;
  var cw = (W - L - R) / rows.length, ch = (H - T - B) / nl;
  rows.forEach(function (r, i) { r.vals.forEach(function (v, l) {
    var t = num(v) ? v / vmax : 0, c = "rgb(" + Math.round(255 * t) + "," + Math.round(220 * (1 - t)) + "," + Math.round(120 * (1 - t)) + ")";
    var rect = el("rect", {x: L + i * cw, y: T + l * ch, width: Math.max(cw, 1), height: Math.max(ch - 1, 1), fill: c, "class": "cell"});
    rect.appendChild(el("title", {}, "layer " + l + ", tokens " + fmt(r.x) + ": cv " + fmt(v))); svg.appendChild(rect); }); });
  for (var l = 0; l < nl; l++) if (nl <= 12 || l % Math.ceil(nl / 12) === 0) svg.appendChild(el("text", {x: 4, y: T + (l + 0.5) * ch + 3}, "layer " + l));
  svg.appendChild(el("text", {x: L, y: H - B + 13}, fmt(rows[0].x))); svg.appendChild(el("text", {x: W - R, y: H - B + 13, "text-anchor": "end"}, fmt(rows[rows.length - 1].x)));
  svg.appendChild(el("text", {x: W / 2 - 20, y: H - 4}, "tokens"));
  svg.appendChild(el("text", {x: W - R + 4, y: T + 10}, "red")); svg.appendChild(el("text", {x: W - R + 4, y: T + 22}, "cv " + fmt(vmax)));
  svg.appendChild(el("text", {x: W - R + 4, y: H - B - 12}, "green")); svg.appendChild(el("text", {x: W - R + 4, y: H - B}, "cv 0"));
}
function thin(a, n) { if (a.length <= n) return a; var k = Math.ceil(a.length / n); return a.filter(function (x, i) { return i % k === 0 || i === a.length - 1; }); }
function pts(ms, key) { return thin(ms.filter(function (m) { return num(m.tokens) && num(mean(m[key])); }).map(function (m) { return [m.tokens, mean(m[key])]; }), 2000); }
function render(D) {
  // this workdir's leg not pushed yet: its own loss series, outside the run's curves
  var ms = (D.metrics || []).filter(function (m) { return !m.not_pushed; });
  var fresh = (D.metrics || []).filter(function (m) { return m.not_pushed; });
  document.getElementById("src").textContent = D.source;
  document.getElementById("updated").textContent = "data read " + new Date(D.generated_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC, " + ms.length + " log points"
    + (fresh.length ? ", " + fresh.length + " of this workdir's leg not pushed yet" : "")
    + (D.left_out && D.left_out.length ? "; left out: " + D.left_out.join(", ") : "");
  var b = D.baton, s = D.state || {}, h = [];
  if (b) {
    if (b.holder) h.push("<span>baton: <b id='holder'>" + esc(b.holder) + "</b> since " + (b.claimed_at ? new Date(b.claimed_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "?") + " (leg " + esc(b.leg) + ", generation " + esc(b.generation) + ", renewed " + Math.round(b.lease_age_s) + "s ago)</span>");
    else h.push("<span>baton: <b id='holder'>free</b>" + (b.expired_holder ? " (lease of " + esc(b.expired_holder) + " expired)" : "") + "</span>");
  } else h.push("<span>local run dir (no relay)</span>");
  h.push("<span>step <b>" + fmt(s.step) + "</b></span>", "<span>tokens <b>" + fmt(s.tokens) + "</b></span>");
  if (s.stage !== undefined && s.stage !== null) h.push("<span>stage <b>" + esc(String(s.stage)) + "</b></span>");
  if (s.legs !== undefined) h.push("<span>legs <b>" + esc(s.legs) + "</b></span>");
  h.push("<span>spent <b id='usd'>$" + Number(s.usd_total || 0).toFixed(2) + "</b></span>");
  // a finished run whose last evaluation a stop signal cut short: a leg measures it (relay.py status says so too)
  if (s.last_eval_due !== undefined && s.last_eval_due !== null) h.push(
    "<span><b id='evaldue'>step " + esc(s.last_eval_due) + "'s evaluation cut short: a leg measures it</b></span>");
  if (s.decay_requested) h.push("<span><b>decay requested</b></span>");
  else if (s.decay !== undefined && s.decay !== null && s.decay !== false) h.push("<span><b>decaying</b></span>");
  document.getElementById("baton").innerHTML = h.join("");
  // the newest row says the trainer warned of an expert-load collapse (its log said so once; nothing else did)
  var c = D.load_collapse, banner = document.getElementById("collapse");
  banner.hidden = !c;
  banner.innerHTML = c ? "WARNING: expert load collapsed at logged step " + esc(c.step) + " (every row since step "
    + esc(c.since) + " says so): a MoE layer starves over half its experts; the trainer's log names the layers and "
    + "bias_update_rate; the dead-expert chart below, dead_frac_layers in metrics.jsonl" : "";
  lineChart("loss", [{name: "loss", pts: pts(ms, "loss")}, {name: "val loss", pts: pts(ms, "val_loss")}].concat(
    fresh.length ? [{name: "loss (not pushed)", pts: pts(fresh, "loss")}] : []), "tokens");
  lineChart("tps", [{name: "tok/s", pts: pts(ms, "tok_per_s")}], "tokens");
  lineChart("mfu", [{name: "MFU", pts: pts(ms, "mfu")}], "tokens");
  lineChart("lr", [{name: "lr", pts: pts(ms, "lr")}], "tokens");
  lineChart("dead", [{name: "dead frac", pts: pts(ms, "dead_frac")}], "tokens");
  heatmap("heat", ms.map(function (m) { return {x: m.tokens, vals: Array.isArray(m.load_cv_layers) ? m.load_cv_layers : m.load_cv}; })
                    .filter(function (r) { return num(r.x) && Array.isArray(r.vals) && r.vals.length; }).filter(function (r, i, a) {
                      return a.length <= 240 || i % Math.ceil(a.length / 240) === 0; }));  // at most ~240 columns
  var rows = D.ledger || [], t = "<table id='ledgertable'><tr><th>leg</th><th>who</th><th>gpu</th><th>steps</th><th>tokens</th><th>wall</th><th>$</th><th>loss start</th><th>loss end</th><th>finished (UTC)</th></tr>";
  rows.forEach(function (r) { t += "<tr><td>" + esc(r.leg) + "</td><td>" + esc(r.who) + "</td><td>" + esc(r.gpu) + "</td><td>" + esc(r.steps) + "</td><td>" + fmt(r.tokens) + "</td><td>" + esc(r.wall) + "</td><td>" + (r.usd === null ? "-" : esc(Number(r.usd).toFixed(2))) + "</td><td>" + fmt(r.loss_start) + "</td><td>" + fmt(r.loss_end) + "</td><td>" + esc(r.finished) + "</td></tr>"; });
  document.getElementById("ledger").innerHTML = rows.length ? t + "</table>" : "<span class='muted'>no legs yet</span>";
}
function esc(x) { return String(x).replace(/[&<>"']/g, function (c) { return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]; }); }
render(DATA);
setInterval(function () { fetch("data.json").then(function (r) { return r.json(); }).then(render).catch(function () { var e = document.getElementById("updated"); if (e) e.textContent = "refresh failed at " + new Date().toISOString().slice(11, 19) + " UTC; showing older data"; }); }, 30000);
</script></body></html>
"""


def served_json(d):
    """d as the bytes both the page (inline, in its <script>) and /data.json serve: "<", ">", "&" escaped, which
    JSON.parse reads back as they were (a "</script>" in the store's text ended the page's script)."""
    return json.dumps(d).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def make_server(args):
    """The dashboard's HTTP server (not started): the store read at most every --refresh seconds and serialized once
    then, whatever the number of viewers (each request made its own copies: ~4 of the data's 60 MiB of JSON a view)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    cache = {"t": 0.0, "body": None, "logs": {}}
    lock = threading.Lock()
    head, tail = PAGE.split("__DATA__")  # (split first: a store named __DATA__ is a title, not the data's place)
    head, tail = head.replace("__TITLE__", html.escape(args.store)).encode(), tail.encode()

    def data():
        with lock:
            if cache["body"] is None or time.time() - cache["t"] > args.refresh:
                cache["body"], cache["t"] = served_json(dashboard_data(args.store, cache["logs"])), time.time()
            return cache["body"]
    data()  # fail early, with the one-line error, on a bad target

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            try:
                body = data()
            except relay.RelayError as e:
                return self.send(503, "text/plain", f"relay dashboard: {e}\n".encode())
            if self.path in ("/", "/index.html"):
                return self.send(200, "text/html; charset=utf-8", head, body, tail)
            if self.path == "/data.json":
                return self.send(200, "application/json", body)
            self.send(404, "text/plain", b"not found\n")

        def do_POST(self):
            self.send(405, "text/plain", b"read-only\n")

        def send(self, code, ctype, *parts):  # (written part by part: the page is not copied whole per request)
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(sum(map(len, parts))))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            for part in parts:
                self.wfile.write(part)

        def log_message(self, *a):
            pass

    try:
        return ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as e:  # a port in use (a second dashboard), a host not on this machine
        raise relay.RelayError(f"dashboard: cannot listen on {args.host}:{args.port} ({e.strerror}); pass another --port "
                         f"(or --host)") from None


def serve(args):
    srv = make_server(args)
    print(f"relay: dashboard for {args.store} at http://{args.host}:{srv.server_address[1]}/", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":  # python relay_dashboard.py TARGET [--port N] is `python relay.py dashboard TARGET ...`
    import sys
    sys.exit(relay.main(["dashboard", *sys.argv[1:]]))
