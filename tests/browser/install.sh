#!/usr/bin/env bash
# Headless Chromium for the HTML report test (tests/test_monitor_runs.py): Debian's package, installed when missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/browser/install.sh: chromium missing and not root; the report browser test will be skipped" >&2
  exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
