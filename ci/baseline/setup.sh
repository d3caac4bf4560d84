#!/usr/bin/env bash
# Installs the current-path baseline's Python packages (numpy, pyzmq, xxhash) into a venv
# and prints the interpreter to pass as `omnirig bench hop|pipeline --python`.
# Usage: ci/baseline/setup.sh [VENV]   (default: $OMNIRIG_BASELINE_VENV or ${TMPDIR:-/tmp}/omnirig-baseline-venv)
set -euo pipefail
venv="${1:-${OMNIRIG_BASELINE_VENV:-${TMPDIR:-/tmp}/omnirig-baseline-venv}}"
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$(dirname "$0")/requirements.txt" >&2
"$venv/bin/python" -c 'import numpy, zmq, xxhash' >&2
echo "$venv/bin/python"
