#!/usr/bin/env bash
# Set up (idempotent), lint, and run the test suite. Extra arguments go to pytest.
# Exit code 5 (no tests collected) is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
VENV=${KVSHARE_VENV:-.venv}
# lint, format check and type check first (settings in pyproject.toml): a failure fails the run
"$VENV/bin/ruff" check sglang_kvshare benchmarks tests examples scripts || exit 1
"$VENV/bin/ruff" format --check sglang_kvshare benchmarks tests examples scripts || exit 1
"$VENV/bin/mypy" || exit 1
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
