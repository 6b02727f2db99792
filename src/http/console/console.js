// The sluice console. It uses only the server's public HTTP APIs (catalog, table stats,
// statements, streams), with the same API key as any client, asked for once and kept in this
// tab's sessionStorage. No framework and no build step: the file is embedded in the binary.
'use strict';

const KEY_STORAGE = 'sluice.apiKey';
const STATS_INTERVAL_MS = 2000;
const SPARK_POINTS = 60;
const MAX_RESULT_ROWS = 1000;
const MAX_TAIL_MESSAGES = 500;
const NUMERIC = new Set(['int', 'uint', 'float']);

const $ = (id) => document.getElementById(id);

/** Creates an element with attributes and children (strings become text, never HTML). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  for (const c of children.flat(Infinity)) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function formatBytes(n) {
  if (!Number.isFinite(n)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i === 0 ? String(n) : n.toFixed(1)) + ' ' + units[i];
}

const formatCount = (n) => Number(n).toLocaleString('en-US');

/** A random statement id (UUID v4 form); works outside secure contexts too. */
function newStatementId() {
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

// ---------------------------------------------------------------------------------------------
// API access

/** An answer that was not a success, in the server's `{code, message, details}` form. */
class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }
  describe() {
    const where = this.status ? `HTTP ${this.status} ${this.code}` : this.code;
    return `${where}: ${this.message}`;
  }
}

const auth = {
  key: sessionStorage.getItem(KEY_STORAGE) || '',
  waiters: [],
};

async function api(path, { method = 'GET', body, headers = {}, signal, raw = false } = {}) {
  for (;;) {
    const h = new Headers(headers);
    if (auth.key) h.set('Authorization', `Bearer ${auth.key}`);
    let payload = body;
    if (body !== undefined && typeof body !== 'string') {
      h.set('Content-Type', 'application/json');
      payload = JSON.stringify(body);
    }
    let res;
    try {
      res = await fetch(path, { method, headers: h, body: payload, signal, cache: 'no-store' });
    } catch (e) {
      if (e.name === 'AbortError') throw e;
      throw new ApiError(0, 'unreachable', `the server did not answer (${e.message})`);
    }
    if (res.status === 401) {
      // Ask for a key once, then repeat the request with it.
      await askForKey(auth.key ? 'The server did not accept this key.' : 'The server needs an API key.');
      continue;
    }
    if (!res.ok) {
      let info = {};
      try { info = await res.json(); } catch { /* not a JSON error body */ }
      throw new ApiError(res.status, info.code || 'error', info.message || res.statusText, info.details);
    }
    if (raw) return res;
    if (res.status === 204) return null;
    return res.json();
  }
}

function askForKey(reason) {
  $('key-reason').textContent = reason;
  $('key-dialog').hidden = false;
  $('key-input').value = '';
  $('key-input').focus();
  return new Promise((resolve) => auth.waiters.push(resolve));
}

function setupKeyDialog() {
  $('key-form').addEventListener('submit', (e) => {
    e.preventDefault();
    auth.key = $('key-input').value.trim();
    sessionStorage.setItem(KEY_STORAGE, auth.key);
    $('key-dialog').hidden = true;
    for (const w of auth.waiters.splice(0)) w();
  });
  $('key-forget').addEventListener('click', () => {
    auth.key = '';
    sessionStorage.removeItem(KEY_STORAGE);
    $('key-input').value = '';
  });
  $('key-change').addEventListener('click', () => {
    askForKey('Enter the key to use from now on.').then(() => show(currentView()));
  });
}

function notice(text, bad = true) {
  const n = $('notice');
  n.textContent = text || '';
  n.hidden = !text;
  n.classList.toggle('bad', bad);
}

// ---------------------------------------------------------------------------------------------
// Views

const views = ['tables', 'query', 'streams'];
const currentView = () => {
  const v = location.hash.replace('#', '');
  return views.includes(v) ? v : 'tables';
};

function show(view) {
  for (const v of views) {
    $(`view-${v}`).hidden = v !== view;
    $(`tab-${v}`).classList.toggle('active', v === view);
  }
  notice('');
  if (view === 'tables') tables.start();
  else tables.stop();
  if (view === 'streams') streams.load();
  if (view === 'query') $('query-editor').focus();
}

// ---------------------------------------------------------------------------------------------
// Tables: the catalog, per-table figures and an ingest-rate sparkline

const tables = {
  timer: null,
  entries: [], // {path, dom: {rows, files, fileBytes, unflushed, spark}, history: [{t, rows}]}
  loaded: false,

  async start() {
    if (!this.loaded) await this.loadCatalog();
    if (this.timer === null) {
      this.timer = setInterval(() => this.poll(), STATS_INTERVAL_MS);
      this.poll();
    }
  },

  stop() {
    if (this.timer !== null) clearInterval(this.timer);
    this.timer = null;
  },

  async loadCatalog() {
    const list = $('tables-list');
    let root;
    try {
      root = await api('/v1/catalog');
    } catch (e) {
      list.replaceChildren(el('div', { class: 'error' }, `Could not read the catalog: ${e.describe ? e.describe() : e}`));
      return;
    }
    this.loaded = true;
    const previous = new Map(this.entries.map((e) => [e.path, e.history]));
    this.entries = [];
    const blocks = [];
    for (const db of root.databases || []) {
      for (const schema of db.schemas || []) {
        const cards = (schema.tables || []).map((t) => this.card(db.name, schema.name, t, previous));
        blocks.push(el('div', { class: 'db' },
          el('h3', {}, `${db.name}.${schema.name}`),
          cards.length ? el('div', { class: 'cards' }, cards) : el('p', { class: 'muted' }, 'no tables')));
      }
    }
    if (!blocks.length) blocks.push(el('p', { class: 'muted' }, 'The catalog is empty.'));
    list.replaceChildren(...blocks);
  },

  card(db, schema, table, previous) {
    const path = `/v1/catalog/databases/${encodeURIComponent(db)}/schemas/${encodeURIComponent(schema)}/tables/${encodeURIComponent(table.name)}`;
    const dd = () => el('dd', {}, '–');
    const dom = { rows: dd(), files: dd(), fileBytes: dd(), unflushed: dd(), rate: dd(), spark: svg('svg', { class: 'sparkline', width: 300, height: 40 }) };
    this.entries.push({ path, dom, history: previous.get(path) || [] });
    const columns = (table.columns || []).map((c) =>
      el('li', {}, c.name, ' ', el('span', { class: 'type' }, c.data_type + (c.expression ? ` = ${c.expression}` : ''))));
    return el('div', { class: 'card', 'data-table': `${db}.${schema}.${table.name}` },
      el('h3', {}, table.name),
      table.comment ? el('p', { class: 'muted' }, table.comment) : null,
      el('ul', { class: 'columns' }, columns),
      el('dl', { class: 'figures' },
        el('dt', {}, 'rows'), dom.rows,
        el('dt', {}, 'Parquet files'), dom.files,
        el('dt', {}, 'Parquet bytes'), dom.fileBytes,
        el('dt', {}, 'unflushed bytes'), dom.unflushed,
        el('dt', {}, 'ingest rate'), dom.rate),
      dom.spark);
  },

  async poll() {
    await Promise.all(this.entries.map(async (entry) => {
      let s;
      try {
        s = await api(`${entry.path}/stats`);
      } catch (e) {
        entry.dom.rows.textContent = e.describe ? e.describe() : String(e);
        return;
      }
      entry.dom.rows.textContent = formatCount(s.rows);
      entry.dom.rows.dataset.rows = String(s.rows);
      entry.dom.files.textContent = formatCount(s.files);
      entry.dom.fileBytes.textContent = formatBytes(s.file_bytes);
      entry.dom.unflushed.textContent = formatBytes(s.unflushed_bytes);
      entry.history.push({ t: performance.now(), rows: s.rows });
      if (entry.history.length > SPARK_POINTS + 1) entry.history.shift();
      this.drawSpark(entry);
    }));
  },

  drawSpark(entry) {
    const h = entry.history;
    const rates = [];
    for (let i = 1; i < h.length; i++) {
      const dt = (h[i].t - h[i - 1].t) / 1000;
      // A drop (a table replaced or truncated) is not negative ingest.
      rates.push(dt > 0 ? Math.max(0, h[i].rows - h[i - 1].rows) / dt : 0);
    }
    const last = rates.length ? rates[rates.length - 1] : 0;
    entry.dom.rate.textContent = `${formatCount(Math.round(last))} rows/s`;
    const width = 300;
    const height = 40;
    const max = Math.max(1, ...rates);
    const step = width / (SPARK_POINTS - 1);
    const offset = width - (rates.length - 1) * step;
    const points = rates.map((r, i) => `${(offset + i * step).toFixed(1)},${(height - 2 - (r / max) * (height - 4)).toFixed(1)}`);
    entry.dom.spark.replaceChildren(
      svg('line', { x1: 0, y1: height - 1, x2: width, y2: height - 1 }),
      svg('polyline', { points: points.join(' ') }),
      svg('title', {}, `peak ${formatCount(Math.round(max))} rows/s over the last ${rates.length} samples`));
  },
};

// ---------------------------------------------------------------------------------------------
// Query: run and cancel statements, results with their types, and a chart when one fits

const query = {
  current: null, // {id, started}

  async run() {
    const statement = $('query-editor').value.trim();
    if (!statement) return;
    const id = newStatementId();
    const started = performance.now();
    this.current = { id, started };
    $('query-run').disabled = true;
    $('query-cancel').disabled = false;
    $('query-error').hidden = true;
    $('query-status').textContent = 'submitting…';
    try {
      let st = await api('/v1/statements', { method: 'POST', body: { statement, statement_id: id, format: 'json' } });
      while (st.status === 'pending' || st.status === 'running') {
        $('query-status').textContent = `${st.status} ${((performance.now() - started) / 1000).toFixed(1)} s`;
        await sleep(100);
        if (this.current?.id !== id) return;
        st = await api(`/v1/statements/${encodeURIComponent(id)}?format=json`);
      }
      if (this.current?.id === id) this.render(st, performance.now() - started);
    } catch (e) {
      if (this.current?.id === id) this.fail(e.describe ? e.describe() : String(e));
    } finally {
      if (this.current?.id === id) {
        $('query-run').disabled = false;
        $('query-cancel').disabled = true;
      }
    }
  },

  async cancel() {
    const id = this.current?.id;
    if (!id) return;
    $('query-cancel').disabled = true;
    try {
      await api(`/v1/statements/${encodeURIComponent(id)}/cancel`, { method: 'POST' });
    } catch (e) {
      this.fail(`cancel failed: ${e.describe ? e.describe() : e}`);
    }
  },

  fail(text) {
    $('query-status').textContent = 'failed';
    $('query-error').textContent = text;
    $('query-error').hidden = false;
  },

  render(st, ms) {
    $('query-chart').replaceChildren();
    $('query-result').replaceChildren();
    if (st.status === 'failed') {
      const code = st.error?.code ? `${st.error.code}: ` : '';
      this.fail(code + (st.error?.message || st.message || 'the statement failed'));
      return;
    }
    if (st.status === 'cancelled') {
      $('query-status').textContent = 'cancelled';
      $('query-error').textContent = st.message || 'the statement was cancelled';
      $('query-error').hidden = false;
      return;
    }
    const rs = st.result_set || { metadata: { fields: [], num_rows: 0 }, rows: [] };
    const fields = rs.metadata.fields;
    const rows = rs.rows || [];
    $('query-status').textContent = `finished: ${formatCount(rows.length)} row${rows.length === 1 ? '' : 's'} in ${(ms / 1000).toFixed(2)} s`;
    const head = el('tr', {}, fields.map((f) => el('th', {}, f.name, el('span', { class: 'type' }, f.data_type))));
    const body = rows.slice(0, MAX_RESULT_ROWS).map((r) => el('tr', {}, r.map((cell, i) =>
      el('td', { class: NUMERIC.has(fields[i]?.data_type) ? 'num' : null },
        cell === null ? el('span', { class: 'null' }, 'null') : cell))));
    const table = el('table', { class: 'grid', id: 'result-table' }, el('thead', {}, head), el('tbody', {}, body));
    const more = rows.length > MAX_RESULT_ROWS ? el('p', { class: 'muted' }, `showing the first ${MAX_RESULT_ROWS} rows`) : null;
    $('query-result').replaceChildren(table, more || '');
    const chart = chartFor(fields, rows);
    if (chart) $('query-chart').replaceChildren(chart);
  },
};

/**
 * A chart for a result, or null when none suits it: a timestamp column plus numeric columns
 * is a time series (lines); one label column plus a numeric column, up to 50 rows, is a bar
 * chart.
 */
function chartFor(fields, rows) {
  if (!rows.length || fields.length < 2) return null;
  const numeric = fields.map((f, i) => (NUMERIC.has(f.data_type) ? i : -1)).filter((i) => i >= 0);
  if (!numeric.length) return null;
  const time = fields.findIndex((f) => f.data_type === 'timestamp');
  if (time >= 0) {
    const points = rows
      .map((r) => ({ x: Date.parse(r[time]), ys: numeric.map((i) => (r[i] === null ? NaN : Number(r[i]))) }))
      .filter((p) => Number.isFinite(p.x))
      .sort((a, b) => a.x - b.x);
    if (!points.length) return null;
    return lineChart(points, numeric.slice(0, 4).map((i) => fields[i].name));
  }
  const label = fields.findIndex((f) => !NUMERIC.has(f.data_type));
  if (rows.length > 50) return null;
  const value = numeric[0];
  const bars = rows.map((r, n) => ({ label: label >= 0 ? String(r[label] ?? 'null') : String(n + 1), y: Number(r[value]) }))
    .filter((b) => Number.isFinite(b.y));
  return bars.length ? barChart(bars, fields[value].name) : null;
}

const CHART = { width: 760, height: 260, left: 64, right: 16, top: 16, bottom: 40 };

function axes(minY, maxY) {
  const { width, height, left, right, top, bottom } = CHART;
  return [
    svg('line', { class: 'axis', x1: left, y1: height - bottom, x2: width - right, y2: height - bottom }),
    svg('line', { class: 'axis', x1: left, y1: top, x2: left, y2: height - bottom }),
    svg('text', { x: left - 6, y: top + 4, 'text-anchor': 'end' }, shortNumber(maxY)),
    svg('text', { x: left - 6, y: height - bottom, 'text-anchor': 'end' }, shortNumber(minY)),
  ];
}

function shortNumber(n) {
  const a = Math.abs(n);
  if (a >= 1e9) return (n / 1e9).toFixed(1) + 'G';
  if (a >= 1e6) return (n / 1e6).toFixed(1) + 'M';
  if (a >= 1e4) return (n / 1e3).toFixed(1) + 'k';
  return Number.isInteger(n) ? String(n) : n.toFixed(2);
}

function yRange(values) {
  let min = Math.min(0, ...values);
  let max = Math.max(...values);
  if (max === min) max = min + 1;
  return [min, max];
}

function lineChart(points, names) {
  const { width, height, left, right, top, bottom } = CHART;
  const all = points.flatMap((p) => p.ys.slice(0, names.length)).filter(Number.isFinite);
  const [minY, maxY] = yRange(all);
  const minX = points[0].x;
  const maxX = points[points.length - 1].x;
  const sx = (x) => left + (maxX === minX ? 0.5 : (x - minX) / (maxX - minX)) * (width - left - right);
  const sy = (y) => height - bottom - ((y - minY) / (maxY - minY)) * (height - top - bottom);
  const series = names.map((name, s) => {
    const pts = points.filter((p) => Number.isFinite(p.ys[s]));
    const line = svg('polyline', { class: `series-${s}`, points: pts.map((p) => `${sx(p.x).toFixed(1)},${sy(p.ys[s]).toFixed(1)}`).join(' ') });
    const dots = pts.length <= 60 ? pts.map((p) => svg('circle', { class: `series-${s}`, cx: sx(p.x).toFixed(1), cy: sy(p.ys[s]).toFixed(1), r: 2.5 })) : [];
    return [line, dots, svg('text', { class: `series-${s}`, x: left + 8 + s * 140, y: height - 6 }, `— ${name}`)];
  });
  return svg('svg', { class: 'chart', 'data-kind': 'line', width, height, viewBox: `0 0 ${width} ${height}` },
    axes(minY, maxY),
    svg('text', { x: left, y: height - bottom + 14 }, new Date(minX).toISOString()),
    svg('text', { x: width - right, y: height - bottom + 14, 'text-anchor': 'end' }, new Date(maxX).toISOString()),
    series);
}

function barChart(bars, name) {
  const { width, height, left, right, top, bottom } = CHART;
  const [minY, maxY] = yRange(bars.map((b) => b.y));
  const slot = (width - left - right) / bars.length;
  const sy = (y) => height - bottom - ((y - minY) / (maxY - minY)) * (height - top - bottom);
  const rects = bars.map((b, i) => {
    const y0 = sy(Math.max(0, minY));
    const y1 = sy(b.y);
    return [
      svg('rect', { class: 'series-0', x: (left + i * slot + slot * 0.15).toFixed(1), y: Math.min(y0, y1).toFixed(1), width: (slot * 0.7).toFixed(1), height: Math.abs(y0 - y1).toFixed(1) },
        svg('title', {}, `${b.label}: ${b.y}`)),
      bars.length <= 20 ? svg('text', { x: (left + i * slot + slot / 2).toFixed(1), y: height - bottom + 14, 'text-anchor': 'middle' }, b.label.slice(0, 14)) : null,
    ];
  });
  return svg('svg', { class: 'chart', 'data-kind': 'bar', width, height, viewBox: `0 0 ${width} ${height}` },
    axes(minY, maxY), rects, svg('text', { x: left + 8, y: height - 6 }, name));
}

// ---------------------------------------------------------------------------------------------
// Streams: list, details with producers, and a live tail over SSE

const streamPath = (name) => '/v1/stream/' + name.split('/').map(encodeURIComponent).join('/');

const streams = {
  selected: null,
  tail: null, // {name, controller, offset}

  async load() {
    const prefix = $('streams-prefix').value;
    let answer;
    try {
      answer = await api(`/v1/streams?prefix=${encodeURIComponent(prefix)}`);
    } catch (e) {
      $('streams-list').replaceChildren(el('div', { class: 'error' }, `Could not list streams: ${e.describe ? e.describe() : e}`));
      return;
    }
    const rows = answer.streams.map((s) => el('tr', { class: s.name === this.selected ? 'selected' : null, 'data-stream': s.name },
      el('td', {}, el('a', { onclick: () => this.select(s.name) }, s.name)),
      el('td', {}, s.content_type),
      el('td', { class: 'num' }, formatBytes(s.bytes)),
      el('td', {}, s.closed ? 'closed' : 'open')));
    const table = rows.length
      ? el('table', { class: 'grid' },
        el('thead', {}, el('tr', {}, el('th', {}, 'name'), el('th', {}, 'content type'), el('th', {}, 'size'), el('th', {}, 'state'))),
        el('tbody', {}, rows))
      : el('p', { class: 'muted' }, prefix ? 'No stream has this prefix.' : 'There are no streams.');
    $('streams-list').replaceChildren(table, answer.truncated ? el('p', { class: 'muted' }, 'more streams match: narrow the prefix') : '');
    const current = answer.streams.find((s) => s.name === this.selected);
    if (current) this.describe(current);
  },

  async select(name) {
    if (this.tail && this.tail.name !== name) this.stopTail();
    this.selected = name;
    $('tail-messages').replaceChildren();
    $('tail-state').textContent = '';
    await this.load();
  },

  describe(s) {
    $('stream-detail').hidden = false;
    $('stream-name').textContent = s.name;
    const fact = (k, v) => [el('dt', {}, k), el('dd', { 'data-fact': k }, v)];
    const lifetime = s.ttl_seconds != null ? `TTL ${s.ttl_seconds} s` : s.expires_at ? `expires ${s.expires_at}` : 'none';
    $('stream-facts').replaceChildren(...[
      fact('content type', s.content_type),
      fact('state', s.closed ? 'closed' : 'open'),
      fact('next offset', s.next_offset),
      fact('bytes', formatCount(s.bytes)),
      fact('lifetime', lifetime),
      s.forked_from ? fact('forked from', s.forked_from) : [],
    ].flat());
    $('stream-producers').replaceChildren(s.producers.length
      ? el('table', { class: 'grid' },
        el('thead', {}, el('tr', {}, el('th', {}, 'producer'), el('th', {}, 'epoch'), el('th', {}, 'last seq'))),
        el('tbody', {}, s.producers.map((p) => el('tr', {}, el('td', {}, p.id), el('td', { class: 'num' }, p.epoch), el('td', { class: 'num' }, p.last_seq)))))
      : el('p', { class: 'muted' }, 'No idempotent producer has written here.'));
  },

  async startTail() {
    const name = this.selected;
    if (!name) return;
    this.stopTail();
    const controller = new AbortController();
    const tail = { name, controller, offset: $('tail-from').value, json: true };
    this.tail = tail;
    $('tail-messages').replaceChildren();
    $('tail-start').disabled = true;
    $('tail-stop').disabled = false;
    // The server ends an SSE response from time to time (and on restarts); the tail resumes
    // from the last offset it was told about.
    while (!controller.signal.aborted) {
      try {
        const res = await api(`${streamPath(name)}?offset=${encodeURIComponent(tail.offset)}&live=sse`, { raw: true, signal: controller.signal });
        tail.json = this.isJson();
        tail.base64 = res.headers.get('stream-sse-data-encoding') === 'base64';
        $('tail-state').textContent = 'live';
        const ended = await this.readEvents(res, tail);
        if (ended) {
          $('tail-state').textContent = 'the stream is closed';
          break;
        }
      } catch (e) {
        if (controller.signal.aborted) break;
        $('tail-state').textContent = `${e.describe ? e.describe() : e}; retrying`;
        if (e.status === 404 || e.status === 410) break;
        await sleep(1000);
      }
    }
    if (this.tail === tail) {
      $('tail-start').disabled = false;
      $('tail-stop').disabled = true;
    }
  },

  isJson() {
    const ct = document.querySelector('[data-fact="content type"]')?.textContent || '';
    return ct.startsWith('application/json');
  },

  stopTail() {
    if (!this.tail) return;
    this.tail.controller.abort();
    this.tail = null;
    $('tail-start').disabled = false;
    $('tail-stop').disabled = true;
    $('tail-state').textContent = 'stopped';
  },

  /** Reads one SSE response; true when the stream was closed by its writer. */
  async readEvents(res, tail) {
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    let closed = false;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = 'message';
        const data = [];
        for (const line of block.split('\n')) {
          if (line.startsWith('event:')) event = line.slice(6).trim();
          else if (line.startsWith('data:')) data.push(line.slice(line.startsWith('data: ') ? 6 : 5));
        }
        const payload = data.join('\n');
        if (event === 'data') this.showData(payload, tail);
        else if (event === 'control') closed = this.control(payload, tail) || closed;
      }
    }
    return closed;
  },

  showData(payload, tail) {
    let messages;
    if (tail.base64) {
      messages = [`(binary, base64) ${payload}`];
    } else if (tail.json) {
      try {
        messages = JSON.parse(payload).map((m) => JSON.stringify(m, null, 2));
      } catch {
        messages = [payload];
      }
    } else {
      messages = [payload];
    }
    const box = $('tail-messages');
    for (const m of messages) box.append(el('pre', { class: 'message' }, m));
    while (box.childElementCount > MAX_TAIL_MESSAGES) box.firstElementChild.remove();
    box.scrollTop = box.scrollHeight;
  },

  control(payload, tail) {
    let c;
    try { c = JSON.parse(payload); } catch { return false; }
    if (c.streamNextOffset) {
      tail.offset = c.streamNextOffset;
      const dd = document.querySelector('[data-fact="next offset"]');
      if (dd) dd.textContent = c.streamNextOffset;
    }
    if (c.streamClosed) {
      const dd = document.querySelector('[data-fact="state"]');
      if (dd) dd.textContent = 'closed';
    }
    return Boolean(c.streamClosed);
  },
};

// ---------------------------------------------------------------------------------------------

async function checkHealth() {
  try {
    const res = await fetch('/v1/health', { cache: 'no-store' });
    $('server-state').textContent = res.ok ? `server ${location.host} is up` : `server answered ${res.status}`;
  } catch (e) {
    $('server-state').textContent = 'the server does not answer';
  }
}

function start() {
  setupKeyDialog();
  $('tables-refresh').addEventListener('click', () => tables.loadCatalog().then(() => tables.poll()));
  $('query-run').addEventListener('click', () => query.run());
  $('query-cancel').addEventListener('click', () => query.cancel());
  $('query-editor').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      query.run();
    }
  });
  $('streams-refresh').addEventListener('click', () => streams.load());
  $('streams-prefix').addEventListener('keydown', (e) => { if (e.key === 'Enter') streams.load(); });
  $('tail-start').addEventListener('click', () => streams.startTail());
  $('tail-stop').addEventListener('click', () => streams.stopTail());
  window.addEventListener('hashchange', () => show(currentView()));
  window.addEventListener('unhandledrejection', (e) => {
    notice(e.reason?.describe ? e.reason.describe() : String(e.reason));
  });
  checkHealth();
  setInterval(checkHealth, 10000);
  show(currentView());
}

start();
