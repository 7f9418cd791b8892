/* swarm dashboard: polls api/v1/state and renders the header, stage map, plots, events and peer detail. */
"use strict";
(function () {
  const POLL_MS = Math.max(250, Math.min(2000, +document.body.dataset.pollMs || 1000));
  const FETCH_TIMEOUT_MS = 5000;
  const LIVE = { online: 1, draining: 1 };
  const STATE_RANK = { online: 0, draining: 1, joining: 2, accused: 3, dead: 4, offline: 5 };
  const $ = (id) => document.getElementById(id);
  const ui = { doc: null, selected: null, peers: new Map(), columns: [], apiDown: null, renderError: null, eventsHtml: "" };

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  const isNum = (v) => typeof v === "number" && isFinite(v);
  function num(v, digits) {
    if (!isNum(v)) return "–";
    return digits === undefined ? v.toLocaleString("en-US") : v.toFixed(digits);
  }
  function duration(s) {
    if (!isNum(s)) return "–";
    s = Math.max(0, Math.floor(s));
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    const hms = `${String(h).padStart(2, "0")}:${String(m).padStart(2, "0")}:${String(sec).padStart(2, "0")}`;
    return d ? `${d}d ${hms}` : hms;
  }
  const ago = (s) => (isNum(s) ? (s < 10 ? s.toFixed(1) : Math.round(s)) + " s ago" : "never");
  const shortId = (id) => (id ? String(id).slice(-8) : "–");
  const clock = (t) => (isNum(t) ? new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false }) : "–");
  const setText = (id, text) => { const el = $(id); if (el.textContent !== text) el.textContent = text; };

  /* ---- header ---- */
  function renderHeader(doc) {
    const run = doc.run || {};
    setText("run-id", run.run_id || "(no run)");
    const sec = $("security");
    sec.textContent = run.security === "private" ? "private swarm" : run.security === "open" ? "open swarm" : "";
    sec.className = "badge " + (run.security || "");
    setText("model", String(run.model ?? "–"));
    setText("num-stages", String(run.num_stages ?? (doc.stages || []).length));
    setText("sync", String(run.sync ?? "–"));
    setText("codec", String(run.codec ?? "–"));
    setText("step", num(doc.step));
    setText("samples-per-s", num(doc.samples_per_s, 1));
    setText("elapsed", duration(doc.elapsed_s));
    const stages = doc.stages || [];
    const dead = stages.filter((s) => !liveCount(s)).map((s) => s.stage);
    const health = $("health");
    health.textContent = doc.healthy && !dead.length ? "healthy" : dead.length ? `unhealthy: no live peer in stage ${dead.join(", ")}` : "unhealthy";
    health.className = "badge " + (doc.healthy && !dead.length ? "ok" : "bad");
    setText("bottleneck", isNum(doc.bottleneck) ? `stage ${doc.bottleneck}` : "–");
    let total = 0, live = 0;
    for (const s of stages) { total += (s.peers || []).length; live += liveCount(s); }
    setText("peer-count", `${live} live / ${total}`);
  }

  function renderAlerts(doc) {
    const alerts = [];
    if (ui.apiDown) alerts.push(["", `API unreachable (retrying): ${ui.apiDown}`]);
    if (doc && doc.dht_ok === false) alerts.push(["", "DHT unreachable"]);
    if (doc && doc.source_error) alerts.push(["warn", `source error: ${doc.source_error} (showing the last good state)`]);
    if (ui.renderError) alerts.push(["warn", `render error: ${ui.renderError}`]);
    const html = alerts.map(([cls, text]) => `<span class="alert ${cls}">${esc(text)}</span>`).join("");
    const el = $("alerts");
    if (el.innerHTML !== html) el.innerHTML = html;
  }

  /* ---- stage map: one innerHTML per column, skipped when the column did not change ---- */
  function liveCount(stage) {
    let n = 0;
    for (const p of stage.peers || []) if (LIVE[p.state]) n++;
    return n;
  }

  function peerCard(p) {
    const state = String(p.state || "offline");
    const label = state === "dead" ? "dead · unreachable" : state === "accused" ? "accused · caught lying" : state;
    const sel = p.peer_id === ui.selected ? " sel" : "";
    return `<div class="peer s-${esc(state)}${sel}" data-peer="${esc(p.peer_id)}" title="${esc(p.peer_id)}">` +
      `<span class="id">${esc(shortId(p.peer_id))}</span><span class="st">${esc(label)}</span>` +
      `<div class="m">${num(p.throughput, 1)}/s · q ${num(p.queue)} · ${ago(p.last_seen_s)}</div>` +
      `<div class="m">step ${num(p.step)}</div></div>`;
  }

  function stageColumn(stage, bottleneck) {
    const peers = (stage.peers || []).slice().sort((a, b) =>
      (STATE_RANK[a.state] ?? 9) - (STATE_RANK[b.state] ?? 9) || String(a.peer_id).localeCompare(String(b.peer_id)));
    const live = liveCount(stage);
    const flag = !live ? `<div class="flag">no live peer</div>` : stage.stage === bottleneck ? `<div class="flag slow">bottleneck</div>` : "";
    const head = `<div class="stage-head"><b>stage ${esc(stage.stage)}</b>` +
      `<div class="sub">${num(stage.throughput, 1)} samples/s · ${live} live / ${peers.length}</div>${flag}</div>`;
    const cls = "stage" + (!live ? " nolive" : "") + (stage.stage === bottleneck ? " bottleneck" : "");
    return { cls, html: head + `<div class="peers">${peers.map(peerCard).join("")}</div>` };
  }

  function renderStages(doc) {
    const map = $("stage-map");
    const stages = doc.stages || [];
    while (ui.columns.length > stages.length) map.removeChild(ui.columns.pop().el);
    while (ui.columns.length < stages.length) {
      const el = document.createElement("div");
      map.appendChild(el);
      ui.columns.push({ el, html: null, scroll: 0 });
    }
    ui.peers = new Map();
    stages.forEach((stage, i) => {
      for (const p of stage.peers || []) ui.peers.set(p.peer_id, { peer: p, stage: stage.stage });
      const col = ui.columns[i], next = stageColumn(stage, doc.bottleneck);
      col.el.dataset.stage = String(stage.stage);
      if (col.el.className !== next.cls) col.el.className = next.cls;
      if (col.html !== next.html) {
        const list = col.el.querySelector(".peers"), top = list ? list.scrollTop : 0;
        col.el.innerHTML = next.html;
        col.html = next.html;
        if (top) col.el.querySelector(".peers").scrollTop = top;
      }
    });
  }

  /* ---- plots ---- */
  function renderPlots(doc) {
    const h = doc.history || {};
    const steps = h.step || [], times = h.time || [];
    const now = isNum(doc.time) ? doc.time : times[times.length - 1] || 0;
    SwarmPlots.line($("plot-loss"), [
      { name: "train", color: "#2b6cb0", xs: steps, ys: h.loss || [] },
      { name: "validation", color: "#c53030", xs: steps, ys: h.val_loss || [] },
    ], { empty: "no loss reported yet" });
    const minutes = times.map((t) => (isNum(t) ? (t - now) / 60 : null));
    const xFmt = (v) => (v === 0 ? "now" : `${+v.toFixed(1)} min`);
    SwarmPlots.line($("plot-throughput"), [{ name: "samples/s", color: "#1f9d55", xs: minutes, ys: h.samples_per_s || [] }],
      { zeroY: true, xFmt });
    const pps = h.peers_per_stage || [];
    const n = (doc.stages || []).length;
    const series = [];
    for (let k = 0; k < n; k++) {
      series.push({ name: `stage ${k}`, color: `hsl(${Math.round((k * 360) / n)},65%,42%)`, xs: minutes, ys: pps.map((row) => (row ? row[k] : null)) });
    }
    SwarmPlots.line($("plot-peers"), series, { zeroY: true, xFmt });
  }

  /* ---- events, newest first ---- */
  function renderEvents(doc) {
    const events = (doc.events || []).slice().sort((a, b) => (b.time || 0) - (a.time || 0)).slice(0, 200);
    const html = events.map((e) =>
      `<li class="k-${esc(e.kind)}" data-time="${isNum(e.time) ? e.time : ""}"><span class="t">${clock(e.time)}</span><span class="k">${esc(e.kind)}</span>` +
      `<span class="p" title="${esc(e.peer_id || "")}">${esc(e.peer_id ? shortId(e.peer_id) : "")}</span>` +
      `<span class="d">${esc(e.detail || "")}</span></li>`).join("");
    if (html !== ui.eventsHtml) { $("events").innerHTML = html || `<li class="muted">no events yet</li>`; ui.eventsHtml = html; }
    const totals = Object.entries(doc.events_total || {}).map(([k, v]) => `${k} ${v}`).join(" · ");
    setText("events-total", totals ? `(since start: ${totals})` : "");
  }

  /* ---- peer detail: stays open across refreshes ---- */
  function renderDetail() {
    const panel = $("detail");
    if (!ui.selected) { panel.hidden = true; return; }
    panel.hidden = false;
    const entry = ui.peers.get(ui.selected);
    setText("detail-title", `peer ${shortId(ui.selected)}`);
    let rows;
    if (!entry) {
      rows = [["peer id", ui.selected], ["state", "no longer listed"]];
    } else {
      const p = entry.peer;
      rows = [["peer id", p.peer_id], ["stage", entry.stage], ["state", p.state === "dead" ? "dead (unreachable)" : p.state],
        ["address", p.address || "–"], ["device", p.device || "–"], ["uptime", duration(p.uptime_s)],
        ["samples processed", num(p.samples_processed)], ["failures", num(p.failures)], ["moves", num(p.moves)],
        ["throughput", `${num(p.throughput, 2)} samples/s`], ["queue", num(p.queue)], ["step", num(p.step)], ["last seen", ago(p.last_seen_s)]];
    }
    const html = rows.map(([k, v]) => `<dt>${esc(k)}</dt><dd data-field="${esc(k)}">${esc(v)}</dd>`).join("");
    const body = $("detail-body");
    if (body.innerHTML !== html) body.innerHTML = html;
  }

  function select(peerId) {
    const prev = ui.selected;
    ui.selected = peerId;
    for (const el of document.querySelectorAll(".peer.sel")) el.classList.remove("sel");
    if (peerId) for (const el of document.querySelectorAll(".peer")) if (el.dataset.peer === peerId) el.classList.add("sel");
    if (prev !== peerId) for (const col of ui.columns) col.html = null; /* the cached columns carry the old selection */
    renderDetail();
  }

  /* ---- the loop ---- */
  function render(doc) {
    const started = performance.now();
    try {
      renderHeader(doc);
      renderStages(doc);
      renderDetail();
      renderEvents(doc);
      renderPlots(doc);
      ui.renderError = null;
    } catch (err) {
      ui.renderError = String((err && err.message) || err);
    }
    renderAlerts(doc);
    window.__swarmLastRenderMs = performance.now() - started;
    window.__swarmRenders = (window.__swarmRenders || 0) + 1;
    if (window.__swarmRendered === undefined && (doc.stages || []).length) {
      void $("stage-map").offsetHeight; /* force layout: the stage map is fully drawn */
      window.__swarmRendered = performance.now();
      performance.mark("swarm-rendered");
    }
  }

  async function poll() {
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), FETCH_TIMEOUT_MS);
    try {
      const resp = await fetch("api/v1/state", { cache: "no-store", signal: ctrl.signal });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      const doc = await resp.json();
      ui.apiDown = null;
      ui.doc = doc;
      render(doc);
    } catch (err) {
      ui.apiDown = err && err.name === "AbortError" ? "timeout" : String((err && err.message) || err);
      renderAlerts(ui.doc);
    } finally {
      clearTimeout(timer);
      setTimeout(poll, POLL_MS);
    }
  }

  $("stage-map").addEventListener("click", (ev) => {
    const card = ev.target.closest("[data-peer]");
    if (card) select(card.dataset.peer === ui.selected ? null : card.dataset.peer);
  });
  $("detail-close").addEventListener("click", () => select(null));
  document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") select(null); });
  poll();
})();
