#!/usr/bin/env bash
# Creates .venv (if missing), installs the build/test requirements and builds fastcomm in place
# against the installed torch. Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -r requirements.txt
python -m pip install -q --disable-pip-version-check --no-build-isolation -e .
# The README's Lightning and accelerate snippets are tested where these install; fastcomm
# itself does not need them, so a machine without them only skips those tests.
python -m pip install -q --disable-pip-version-check -r requirements-integrations.txt \
  || echo "setup_env: requirements-integrations.txt did not install; tests/test_integrations.py will skip" >&2
