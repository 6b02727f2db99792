"""Stream appends under fsync durability and under object-store durability, side by side.

Usage: python3 benches/object_store_appends.py PATH/TO/sluice s3://bucket/prefix
with AWS_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP set for a
loopback S3 server (the SeaweedFS `weed mini` that tests/run.sh installs). Sequential
256-byte appends on 1, 16 and 64 keep-alive connections (one stream each); prints appends/s,
p50 and p99 per durability. Figures: benches/README.md.
"""
import http.client, threading, time, subprocess, os, sys, statistics, socket, shutil
BIN = sys.argv[1]
S3 = sys.argv[2]
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
def start(mode, d):
    shutil.rmtree(d, ignore_errors=True)
    port = free_port()
    args = [BIN, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", d, "--durability", mode]
    if mode == "object-store":
        args += ["--object-store", S3]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "SLUICE_API_KEYS": ""})
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2); c.request("GET", "/v1/health")
            if c.getresponse().status == 200: break
        except Exception: pass
        time.sleep(0.05)
    return p, port
def worker(port, stream, n, lat):
    c = http.client.HTTPConnection("127.0.0.1", port)
    body = b"x" * 256
    for i in range(n):
        t = time.perf_counter()
        c.request("POST", f"/v1/stream/{stream}", body=body, headers={"content-type": "application/octet-stream"})
        r = c.getresponse(); r.read()
        assert r.status in (200, 204), r.status
        lat.append(time.perf_counter() - t)
def run(port, conns, n):
    for s in range(conns):
        c = http.client.HTTPConnection("127.0.0.1", port)
        c.request("PUT", f"/v1/stream/m{s}", headers={"content-type": "application/octet-stream"}); c.getresponse().read()
    lat = []; threads = [threading.Thread(target=worker, args=(port, f"m{s}", n, lat)) for s in range(conns)]
    t = time.perf_counter(); [th.start() for th in threads]; [th.join() for th in threads]; el = time.perf_counter() - t
    lat.sort()
    return len(lat) / el, lat[len(lat)//2] * 1000, lat[int(len(lat)*0.99)] * 1000
for mode in ["fsync", "object-store"]:
    p, port = start(mode, f"/tmp/os-measure/data-{mode}")
    for conns, n in [(1, 400), (16, 150), (64, 60)]:
        rate, p50, p99 = run(port, conns, n)
        print(f"{mode:13} {conns:3} conns: {rate:8.0f} appends/s  p50 {p50:6.2f} ms  p99 {p99:6.2f} ms", flush=True)
    p.terminate(); p.wait()
