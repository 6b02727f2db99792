"""Chaos run: three object-store nodes under mixed load, killed and paused at random, and
verified after every event.

Usage: python3 benches/chaos.py PATH/TO/sluice [--minutes M] [--seed N] [--workdir DIR]

Starts its own SeaweedFS (`.tools/venv/bin/weed`, which `bash tests/run.sh` installs) on free
loopback ports, and three nodes with `--durability object-store` and a 2 s lease sharing one
bucket: node 0 never flushes or checkpoints in the run (everything stays in its log), node 1
flushes and checkpoints every second, node 2 runs the defaults.

Load, all the time, each request to a random live node:
- 4 ingesters: 10 rows per request into table `t`, every id used once.
- 3 idempotent producers, one stream each (`Producer-Id`, epoch 0, `Producer-Seq`): an
  append that fails is sent again, same sequence number, to the next node, until answered.
- A namer: creates a new stream name on two nodes at once, appends through both, and reads
  it through a third (one name must be one stream: both appends in it).
- A reader: `count(*)` statements.

Events, every 3-8 s: `kill -9` of a live node (its data directory deleted half the time,
restarted 1-4 s later), or `SIGSTOP` for 2-4 leases then `SIGCONT`. At least two nodes stay
up. After each event the run checks, while the load goes on:
- every row acknowledged before the event is in `t` exactly once (no id twice, ever);
- every producer's stream holds its sequence numbers 0, 1, 2, ... with no gap or repeat, at
  least up to the last one acknowledged before the event;
and it times how long the check took to pass (a dead node's writes come back when another
node takes its id over, about two leases). A check that has not passed after 90 s fails the
run. The summary prints the figures; the exit status is 1 on any violation.
"""
import argparse, atexit, http.client, json, os, random, shutil, signal, socket, subprocess, sys, threading, time

LEASE = 2
ap = argparse.ArgumentParser()
ap.add_argument("binary")
ap.add_argument("--minutes", type=float, default=5)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--workdir", default="target/chaos")
args = ap.parse_args()
random.seed(args.seed)
BIN = os.path.abspath(args.binary)
WORK = os.path.abspath(args.workdir)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- the store -----------------------------------------------------------------------------
weed = os.path.join(os.path.dirname(__file__), "..", ".tools", "venv", "bin", "weed")
s3_port = free_port()
weed_args = [weed, "mini", f"-dir={WORK}/s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             "-webdav=false", "-admin.ui=false", f"-s3.port={s3_port}", "-s3.port.iceberg=0",
             "-s3.port.lance=0", "-master.telemetry=false", "-bucket=chaos",
             f"-master.port={free_port()}", f"-volume.port={free_port()}",
             f"-filer.port={free_port()}", f"-admin.port={free_port()}"]
os.makedirs(f"{WORK}/s3")
ENV = dict(os.environ, AWS_ACCESS_KEY_ID="chaos", AWS_SECRET_ACCESS_KEY="chaos-secret",
           AWS_ENDPOINT=f"http://127.0.0.1:{s3_port}", AWS_ALLOW_HTTP="true",
           AWS_REGION="us-east-1", SLUICE_API_KEYS="", RUST_LOG="info")
# weed mini takes its credentials from the same variables.
weed_proc = subprocess.Popen(weed_args, env=ENV, stdout=open(f"{WORK}/weed.log", "w"),
                             stderr=subprocess.STDOUT)


def request(port, method, path, body=None, headers=None, timeout=30):
    """(status, headers, body) or None when the node did not answer."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, dict(r.getheaders()), data
    except Exception:
        return None


def read_stream(port, name):
    """(status, whole body) of stream `name` read through the node at `port`, following
    Stream-Next-Offset until an answer says Stream-Up-To-Date (a node answers what the
    owner's snapshot holds itself, and that answer never says it); None when a page got no
    answer."""
    offset, body = "-1", b""
    for _ in range(10_000):
        r = request(port, "GET", f"/v1/stream/{name}?offset={offset}")
        if not r or r[0] != 200:
            return r and (r[0], body)
        headers = {k.lower(): v for k, v in r[1].items()}
        body += r[2]
        if headers.get("stream-up-to-date") == "true" or "stream-next-offset" not in headers:
            return 200, body
        offset = headers["stream-next-offset"]
    return None


CONFIGS = [
    "flush_interval_seconds = 600\nstream_checkpoint_interval_seconds = 600\n",
    "flush_interval_seconds = 1\nstream_checkpoint_interval_seconds = 1\n",
    "",
]


class Node:
    def __init__(self, i):
        self.i, self.name = i, f"node{i}"
        self.dir = f"{WORK}/{self.name}"
        self.config = f"{WORK}/{self.name}.toml"
        with open(self.config, "w") as f:
            f.write(CONFIGS[i])
        self.port = free_port()
        self.proc = None
        self.paused_until = 0.0

    def start(self, attempts=5):
        """Starts the node; one that exits while starting (fenced while it replayed) is
        started again, as a supervisor would."""
        for attempt in range(attempts):
            try:
                return self.start_once()
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                time.sleep(1)

    def start_once(self):
        os.makedirs(self.dir, exist_ok=True)
        log = open(f"{WORK}/{self.name}.log", "a")
        self.proc = subprocess.Popen(
            [BIN, "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", self.dir,
             "--object-store", "s3://chaos/db", "--durability", "object-store",
             "--node-lease-seconds", str(LEASE), "--config", self.config],
            env=ENV, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            r = request(self.port, "GET", "/v1/health", timeout=2)
            if r and r[0] == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not start")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


deadline = time.time() + 60
while request(s3_port, "GET", "/", timeout=1) is None:
    if time.time() > deadline:
        sys.exit("SeaweedFS did not start; see " + f"{WORK}/weed.log")
    time.sleep(0.5)
time.sleep(2)
nodes = [Node(i) for i in range(3)]


@atexit.register
def cleanup():
    for n in nodes:
        n.kill()
    weed_proc.kill()


for n in nodes:
    n.start()


def live():
    return [n for n in nodes if n.alive() and n.paused_until < time.time()]


def statement(stmt, timeout=120):
    """The finished answer of `stmt` from the first live node that gives one."""
    for n in random.sample(live(), len(live())):
        r = request(n.port, "POST", "/v1/statements",
                    json.dumps({"statement": stmt, "format": "json"}),
                    {"content-type": "application/json"}, timeout)
        deadline = time.time() + timeout
        while r and r[0] == 200 and time.time() < deadline:
            answer = json.loads(r[2])
            if answer.get("status") == "finished":
                return answer
            if answer.get("status") not in ("pending", "running"):
                break
            time.sleep(0.2)
            r = request(n.port, "GET", f"/v1/statements/{answer['statement_id']}?format=json")
    return None


assert statement("CREATE TABLE t (id int, s string)") is not None
STREAMS = [f"s{i}" for i in range(3)]
for i, s in enumerate(STREAMS):
    r = request(nodes[i].port, "PUT", f"/v1/stream/{s}", headers={"content-type": "text/plain"})
    assert r and r[0] == 201, r

lock = threading.Lock()
rows_acked, rows_unknown = set(), set()
appends_acked = {s: 0 for s in STREAMS}
counters = {"ingest_requests": 0, "ingest_refused": 0, "append_retries": 0, "names": 0,
            "names_checked": 0, "queries": 0}
violations = []
refusals = {}


def violation(what):
    print("VIOLATION: " + what, flush=True)
    violations.append(what)


stop = threading.Event()
next_block = [0]


def ingester():
    while not stop.is_set():
        with lock:
            base = next_block[0]
            next_block[0] += 10
        ids = list(range(base, base + 10))
        body = "".join(json.dumps({"id": i, "s": f"r{i}"}) + "\n" for i in ids)
        targets = live()
        if not targets:
            time.sleep(0.1)
            continue
        n = random.choice(targets)
        r = request(n.port, "POST", "/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest",
                    body, {"content-type": "application/x-ndjson"})
        with lock:
            counters["ingest_requests"] += 1
            if r and r[0] == 200:
                rows_acked.update(ids)
            else:
                counters["ingest_refused"] += 1
                rows_unknown.update(ids)
                why = r[0] if r else "no answer"
                refusals[why] = refusals.get(why, 0) + 1
        # Paced, so the table stays within one statement's result limit on long runs.
        time.sleep(0.02 if r and r[0] == 200 else 0.1)


def producer(stream):
    seq = 0
    while not stop.is_set():
        targets = live()
        random.shuffle(targets)
        done = False
        for n in targets:
            r = request(n.port, "POST", f"/v1/stream/{stream}", f"{seq};",
                        {"content-type": "text/plain", "Producer-Id": "p",
                         "Producer-Epoch": "0", "Producer-Seq": str(seq)})
            if r and r[0] in (200, 204):
                done = True
                break
            with lock:
                counters["append_retries"] += 1
        if done:
            with lock:
                appends_acked[stream] = seq + 1
            seq += 1
        else:
            time.sleep(0.2)


def namer():
    k = 0
    while not stop.is_set():
        time.sleep(0.5)
        targets = live()
        if len(targets) < 2:
            continue
        a, b = random.sample(targets, 2)
        name = f"n{k}"
        k += 1
        answers = [None, None]

        def put(slot, node):
            answers[slot] = request(node.port, "PUT", f"/v1/stream/{name}",
                                    headers={"content-type": "text/plain"})
        ts = [threading.Thread(target=put, args=(0, a)), threading.Thread(target=put, args=(1, b))]
        [t.start() for t in ts]
        [t.join() for t in ts]
        created = [x[0] for x in answers if x]
        with lock:
            counters["names"] += 1
        if created.count(201) > 1:
            violation(f"name {name}: created twice ({created})")
        if sorted(created) != [200, 201]:
            continue
        ok = [request(n.port, "POST", f"/v1/stream/{name}", f"{n.name};",
                      {"content-type": "text/plain"}) for n in (a, b)]
        if not all(x and x[0] in (200, 204) for x in ok):
            continue
        reader = random.choice(live() or [a])
        r = read_stream(reader.port, name)
        if r and r[0] == 200:
            got = sorted(m for m in r[1].decode().split(";") if m)
            with lock:
                counters["names_checked"] += 1
            if got != sorted([a.name, b.name]):
                violation(f"name {name}: one stream should hold both appends, {reader.name} has {got}")


def reader():
    while not stop.is_set():
        time.sleep(1)
        if statement("SELECT count(*) FROM t", timeout=30) is not None:
            with lock:
                counters["queries"] += 1


def check(rows_before, appends_before):
    """None when everything acknowledged before is there exactly once, else why not."""
    answer = statement("SELECT id FROM t")
    if answer is None:
        return "no node answered the query"
    ids = [int(row[0]) for row in answer["result_set"]["rows"]]
    seen = set(ids)
    if len(seen) != len(ids):
        dups = len(ids) - len(seen)
        violation(f"{dups} rows twice")
        return f"{dups} rows twice"
    missing = rows_before - seen
    if missing:
        return f"{len(missing)} acknowledged rows missing"
    for s in STREAMS:
        targets = live()
        if not targets:
            return "no live node"
        r = read_stream(random.choice(targets).port, s)
        if not r or r[0] != 200:
            return f"stream {s} not served ({r[0] if r else 'no answer'})"
        seqs = [int(m) for m in r[1].decode().split(";") if m]
        if seqs != list(range(len(seqs))):
            violation(f"stream {s}: not 0..n in order")
            return f"stream {s} out of order"
        if len(seqs) < appends_before[s]:
            return f"stream {s}: {len(seqs)} of {appends_before[s]} acknowledged appends"
    return None


threads = [threading.Thread(target=ingester, daemon=True) for _ in range(4)]
threads += [threading.Thread(target=producer, args=(s,), daemon=True) for s in STREAMS]
threads += [threading.Thread(target=namer, daemon=True), threading.Thread(target=reader, daemon=True)]
for t in threads:
    t.start()
t0 = time.time()
events = []
recoveries = []
failed_checks = 0
while time.time() - t0 < args.minutes * 60 and not violations:
    time.sleep(random.uniform(3, 8))
    up = [n for n in nodes if n.alive()]
    victim = random.choice(up) if len(up) >= 3 else None
    if victim is None:
        # A node exited by itself (one that finds it was fenced does): only its restart.
        events.append(("exited by itself", next(n.name for n in nodes if not n.alive())))
    elif random.random() < 0.6:
        wipe = random.random() < 0.5
        victim.kill()
        if wipe:
            shutil.rmtree(victim.dir, ignore_errors=True)
        events.append(("kill -9 and wipe" if wipe else "kill -9", victim.name))
    else:
        pause = random.uniform(2 * LEASE, 4 * LEASE)
        victim.paused_until = time.time() + pause
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(pause)
        victim.proc.send_signal(signal.SIGCONT)
        victim.paused_until = 0
        events.append((f"SIGSTOP {pause:.1f} s", victim.name))
    with lock:
        rows_before, appends_before = set(rows_acked), dict(appends_acked)
    # The dead node comes back a little later, under load.
    time.sleep(random.uniform(1, 4))
    for n in nodes:
        if not n.alive():
            n.start()
            events[-1] = events[-1] + ("restarted",)
    started = time.time()
    why = check(rows_before, appends_before)
    while why is not None and time.time() - started < 90 and not violations:
        time.sleep(1)
        why = check(rows_before, appends_before)
    took = time.time() - started
    at = time.time() - t0
    if why is None:
        recoveries.append(took)
        print(f"{at:7.1f} s  {' '.join(events[-1]):40}  verified in {took:5.1f} s "
              f"({len(rows_before)} rows, {sum(appends_before.values())} appends)", flush=True)
    else:
        failed_checks += 1
        violation(f"after {events[-1]}: {why} after 90 s")
        print(f"{at:7.1f} s  {' '.join(events[-1]):40}  NOT VERIFIED: {why}", flush=True)
elapsed = time.time() - t0
stop.set()
for t in threads:
    t.join()
for n in nodes:
    if not n.alive():
        n.start()
with lock:
    rows_before, appends_before = set(rows_acked), dict(appends_acked)
started = time.time()
why = check(rows_before, appends_before)
while why is not None and time.time() - started < 90:
    time.sleep(1)
    why = check(rows_before, appends_before)
if why is not None:
    violation(f"final check: {why}")
recoveries.sort()
kills = sum(1 for e in events if e[0].startswith("kill"))
wipes = sum(1 for e in events if "wipe" in e[0])
pauses = sum(1 for e in events if e[0].startswith("SIGSTOP"))
exits = sum(1 for e in events if e[0].startswith("SIGSTOP") and "restarted" in e)
print()
print(f"chaos run, seed {args.seed}: {elapsed / 60:.1f} min, {len(events)} events "
      f"({kills} kill -9, {wipes} of them with the data directory deleted, {pauses} SIGSTOP, "
      f"after {exits} of which the paused node found it was fenced and exited)")
print(f"rows acknowledged: {len(rows_acked)} ({len(rows_acked) / elapsed:.0f}/s), "
      f"ingest requests {counters['ingest_requests']}, refused or unanswered {counters['ingest_refused']} "
      f"({', '.join(f'{k}: {v}' for k, v in sorted(refusals.items(), key=str))})")
print(f"appends acknowledged: {sum(appends_acked.values())} ({sum(appends_acked.values()) / elapsed:.0f}/s), "
      f"failed attempts retried {counters['append_retries']}")
print(f"names raced on two nodes: {counters['names']}, checked as one stream: {counters['names_checked']}; "
      f"count(*) statements answered: {counters['queries']}")
if recoveries:
    print(f"verified after {len(recoveries)} of {len(events)} events; time to verify: "
          f"median {recoveries[len(recoveries) // 2]:.1f} s, max {recoveries[-1]:.1f} s")
print(f"final check: {'every acknowledged row once, every stream complete and in order' if why is None else why}")
for n in nodes:
    n.kill()
weed_proc.kill()
if violations:
    print("VIOLATIONS:")
    for v in violations[:20]:
        print("  " + v)
    sys.exit(1)
