// Drives the console of a running `sluice serve` in headless Chromium (Debian's package, started
// by playwright-core through `executablePath`). Run by tests/console.rs, which starts the server
// with an API key and seeds the `events` table and a JSON stream. Exits non-zero on the first
// failed check; screenshots go to OUT_DIR.
import assert from 'node:assert/strict';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const base = process.env.SLUICE_URL;
const key = process.env.SLUICE_KEY;
const stream = process.env.SLUICE_STREAM;
const out = process.env.OUT_DIR;
const executablePath = process.env.CHROMIUM || '/usr/bin/chromium';
assert.ok(base && key && stream && out, 'SLUICE_URL, SLUICE_KEY, SLUICE_STREAM and OUT_DIR are set');
mkdirSync(out, { recursive: true });

const TIMEOUT = 20_000;
const step = (what) => console.log(`console test: ${what}`);

/** A request to the server as any client makes it. */
async function call(method, path, body, headers = {}) {
  const res = await fetch(base + path, {
    method,
    headers: { Authorization: `Bearer ${key}`, ...headers },
    body,
  });
  const text = await res.text();
  assert.ok(res.ok, `${method} ${path} answered ${res.status}: ${text}`);
  return res;
}

const browser = await chromium.launch({
  executablePath,
  headless: true,
  // Without the background-networking flags Chromium keeps dialing out, and this machine's
  // closed network refuses it.
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
const problems = [];
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  page.setDefaultTimeout(TIMEOUT);
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  page.on('console', (m) => {
    // The unauthenticated first request's 401 is expected: it is what asks for the key.
    if (m.type() === 'error' && !m.text().includes('status of 401')) problems.push(`console: ${m.text()}`);
  });

  step('open the console; it asks for the key once');
  await page.goto(`${base}/#tables`);
  await page.locator('#key-dialog').waitFor({ state: 'visible' });
  await page.fill('#key-input', key);
  await page.click('#key-save');
  await page.locator('#key-dialog').waitFor({ state: 'hidden' });
  const stored = await page.evaluate(() => sessionStorage.getItem('sluice.apiKey'));
  assert.equal(stored, key, 'the key is kept in the session');

  step('tables: columns, types and live figures');
  const card = page.locator('[data-table="scopedb.public.events"]');
  await card.waitFor();
  const columns = await card.locator('.columns li').allInnerTexts();
  assert.deepEqual(columns, ['time timestamp', 'service string', 'name string', 'message string', 'var object']);
  const rows = card.locator('.figures dd').first();
  await page.waitForFunction((el) => el.dataset.rows === '25', await rows.elementHandle());
  // Rows ingested while the page is open show up in the figures and the sparkline.
  const more = Array.from({ length: 10 }, (_, i) => JSON.stringify({
    time: `2026-10-24T0${i}:00:00Z`, service: 'web', name: 'page_view', message: `view ${i}`, var: { i },
  })).join('\n');
  await call('POST', '/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest', more,
    { 'Content-Type': 'application/x-ndjson' });
  await page.waitForFunction((el) => el.dataset.rows === '35', await rows.elementHandle());
  await page.waitForFunction(() => {
    const line = document.querySelector('[data-table="scopedb.public.events"] svg.sparkline polyline');
    return line && line.getAttribute('points').split(' ').length >= 2;
  });
  const rate = await card.locator('.figures dd').nth(4).innerText();
  assert.match(rate, /rows\/s$/);
  await page.screenshot({ path: join(out, 'tables.png'), fullPage: true });

  step("query: the seed's ScopeQL verification query");
  await page.click('#tab-query');
  await page.fill('#query-editor', [
    'FROM events',
    "WHERE time = '2026-10-23T09:00:00Z'::timestamp AND service = 'checkout'",
    "SELECT time, name, message, var['gateway']::string AS gateway",
    'LIMIT 10',
  ].join('\n'));
  await page.click('#query-run');
  await page.locator('#result-table').waitFor();
  const headers = await page.locator('#result-table thead th').allInnerTexts();
  assert.deepEqual(headers.map((h) => h.replace(/\s+/g, ' ')),
    ['time timestamp', 'name string', 'message string', 'gateway string']);
  const gateway = await page.locator('#result-table tbody tr').first().locator('td').nth(3).innerText();
  assert.equal(gateway, 'credit_card');
  console.log(`console test: result cell gateway = ${gateway}`);
  assert.match(await page.locator('#query-status').innerText(), /^finished: 1 row/);
  await page.screenshot({ path: join(out, 'query.png'), fullPage: true });

  step('query: a time series gets a line chart');
  await page.fill('#query-editor',
    "SELECT time, count(*) AS n FROM events WHERE service = 'web' GROUP BY time ORDER BY time");
  await page.keyboard.press('Control+Enter');
  await page.locator('#query-chart svg[data-kind="line"]').waitFor();
  const points = await page.locator('#query-chart svg polyline').getAttribute('points');
  assert.equal(points.split(' ').length, 34, 'one point per row');
  assert.equal(await page.locator('#result-table tbody tr').count(), 34);
  await page.screenshot({ path: join(out, 'query-chart.png'), fullPage: true });

  step('query: errors read as errors');
  await page.fill('#query-editor', 'SELECT no_such_column FROM events');
  await page.click('#query-run');
  await page.locator('#query-error').waitFor({ state: 'visible' });
  assert.match(await page.locator('#query-error').innerText(), /no_such_column/);
  assert.equal(await page.locator('#result-table').count(), 0, 'a failed statement shows no stale result');

  step('query: a long statement is cancelled');
  await page.fill('#query-editor', 'SELECT sum(value % 7) AS s FROM range(0, 100000000000)');
  await page.click('#query-run');
  await page.waitForFunction(() => document.getElementById('query-status').textContent.startsWith('running'));
  await page.click('#query-cancel');
  await page.waitForFunction(() => document.getElementById('query-status').textContent === 'cancelled');
  assert.equal(await page.locator('#query-run').isEnabled(), true);

  step('streams: list, details, producers');
  await page.click('#tab-streams');
  const entry = page.locator(`[data-stream="${stream}"] a`);
  await entry.click();
  await page.locator('#stream-detail').waitFor({ state: 'visible' });
  assert.equal(await page.locator('[data-fact="content type"]').innerText(), 'application/json');
  assert.equal(await page.locator('[data-fact="state"]').innerText(), 'open');
  const producer = await page.locator('#stream-producers tbody tr').first().locator('td').allInnerTexts();
  assert.deepEqual(producer, ['console-test-producer', '0', '1']);

  step('streams: a live tail sees a message appended after the page opened');
  await page.click('#tail-start');
  await page.waitForFunction(() => document.getElementById('tail-state').textContent === 'live');
  const appended = await call('POST', `/v1/stream/${stream}`,
    JSON.stringify({ hello: 'appended after the page opened', n: 42 }),
    { 'Content-Type': 'application/json' });
  const next = appended.headers.get('stream-next-offset');
  const message = page.locator('#tail-messages .message').filter({ hasText: '"hello": "appended after the page opened"' });
  await message.waitFor();
  assert.match(await message.innerText(), /^\{\n {2}"hello": "appended after the page opened",\n {2}"n": 42\n\}$/);
  await page.waitForFunction((n) => document.querySelector('[data-fact="next offset"]').textContent === n, next);
  // Only the new message: the tail started at "now".
  assert.equal(await page.locator('#tail-messages .message').count(), 1);
  await page.screenshot({ path: join(out, 'streams.png'), fullPage: true });
  await page.click('#tail-stop');

  assert.deepEqual(problems, [], 'no script errors and no blocked resources');
  step(`all checks passed; screenshots in ${out}`);
} finally {
  await browser.close();
}
