#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
# Exit code 5 (no tests collected) is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
VENV=${KVSHARE_VENV:-.venv}
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
