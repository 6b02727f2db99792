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

# The Durable Streams conformance suite and client (tests/streams.rs drives them with node).
# Reinstalled whenever the lock file changes.
if ! cmp -s tests/conformance/package-lock.json tests/conformance/node_modules/.installed-lock; then
  echo "installing the Durable Streams test packages into tests/conformance/node_modules" >&2
  npm ci --prefix tests/conformance --no-audit --no-fund --loglevel=error
  cp tests/conformance/package-lock.json tests/conformance/node_modules/.installed-lock
fi

# Incremental state only costs disk and time on a one-off CI build.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test --locked "$@"
