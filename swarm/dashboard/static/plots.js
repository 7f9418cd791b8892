/* swarm dashboard: hand-written SVG line plots (no library). Exposes window.SwarmPlots. */
"use strict";
(function () {
  const W = 600, H = 220, M = { l: 48, r: 10, t: 18, b: 24 };
  const MAX_POINTS = 800;

  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
    return ticks;
  }

  function fmtTick(v) {
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (a >= 100 || v === Math.round(v)) return String(Math.round(v));
    return v.toFixed(a >= 10 ? 1 : 2);
  }

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  /* Finite (x, y) pairs of a series, thinned to at most MAX_POINTS (null entries are skipped: the line joins across them). */
  function points(xs, ys) {
    const out = [];
    const n = Math.min(xs.length, ys.length);
    const stride = Math.max(1, Math.ceil(n / MAX_POINTS));
    for (let i = 0; i < n; i++) {
      const x = xs[i], y = ys[i];
      if (typeof x !== "number" || typeof y !== "number" || !isFinite(x) || !isFinite(y)) continue;
      if (stride > 1 && i % stride !== 0 && i !== n - 1) continue;
      out.push([x, y]);
    }
    return out;
  }

  function extent(all, pick, zero) {
    let lo = Infinity, hi = -Infinity;
    for (const pts of all) for (const p of pts) { const v = p[pick]; if (v < lo) lo = v; if (v > hi) hi = v; }
    if (lo === Infinity) return null;
    if (zero && lo > 0) lo = 0;
    if (hi === lo) { hi = lo + 1; if (!zero) lo -= 1; }
    return [lo, hi];
  }

  /* Draw `series` ([{name, color, xs, ys}]) into `svg`. opts: {xFmt, zeroY, empty}. */
  function line(svg, series, opts) {
    opts = opts || {};
    const pts = series.map((s) => points(s.xs || [], s.ys || []));
    const xr = extent(pts, 0, false), yr = extent(pts, 1, !!opts.zeroY);
    if (!xr || !yr) {
      svg.innerHTML = `<text class="empty" x="${W / 2}" y="${H / 2}" text-anchor="middle">${esc(opts.empty || "no data yet")}</text>`;
      return;
    }
    if (!opts.zeroY) { const pad = (yr[1] - yr[0]) * 0.05; yr[0] -= pad; yr[1] += pad; }
    const sx = (x) => M.l + ((x - xr[0]) / (xr[1] - xr[0] || 1)) * (W - M.l - M.r);
    const sy = (y) => H - M.b - ((y - yr[0]) / (yr[1] - yr[0] || 1)) * (H - M.t - M.b);
    const xFmt = opts.xFmt || fmtTick;
    const parts = [];
    for (const t of niceTicks(yr[0], yr[1], 4)) {
      const y = sy(t).toFixed(1);
      parts.push(`<line class="grid" x1="${M.l}" x2="${W - M.r}" y1="${y}" y2="${y}"/>`);
      parts.push(`<text x="${M.l - 4}" y="${y}" dy="3.5" text-anchor="end">${esc(fmtTick(t))}</text>`);
    }
    for (const t of niceTicks(xr[0], xr[1], 5)) {
      const x = sx(t).toFixed(1);
      parts.push(`<text x="${x}" y="${H - 6}" text-anchor="middle">${esc(xFmt(t))}</text>`);
    }
    parts.push(`<line class="axis" x1="${M.l}" x2="${W - M.r}" y1="${H - M.b}" y2="${H - M.b}"/>`);
    parts.push(`<line class="axis" x1="${M.l}" x2="${M.l}" y1="${M.t}" y2="${H - M.b}"/>`);
    let legendX = M.l;
    series.forEach((s, i) => {
      if (pts[i].length) {
        const d = pts[i].map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join("");
        parts.push(`<path class="line" stroke="${esc(s.color)}" d="${d}"/>`);
        if (pts[i].length === 1) parts.push(`<circle r="2.5" fill="${esc(s.color)}" cx="${sx(pts[i][0][0])}" cy="${sy(pts[i][0][1])}"/>`);
      }
      parts.push(`<text x="${legendX}" y="11" style="fill:${esc(s.color)}">■ ${esc(s.name)}</text>`);
      legendX += 14 + 7 * String(s.name).length;
    });
    svg.innerHTML = parts.join("");
  }

  window.SwarmPlots = { line, niceTicks, fmtTick };
})();
