#!/usr/bin/env bash
# Chromium for the dashboard's headless-browser test (tests/api/test_dashboard.py), from Debian's
# packages: installed with apt-get only when no `chromium` is on PATH (needs root, as on CI).
set -euo pipefail
source "$(dirname "$0")/retry.sh"
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ensure-chromium: chromium is missing; run as root (or: sudo apt-get install -y chromium)" >&2
  exit 1
fi
echo "ensure-chromium: installing chromium with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
retry apt-get update -q
retry apt-get install -y -q --no-install-recommends chromium fonts-liberation  # a font, so screenshots show text
command -v chromium >/dev/null
