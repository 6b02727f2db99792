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

# Incremental state only costs disk and time on a one-off CI build.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo test --locked "$@"
