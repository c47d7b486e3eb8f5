#!/usr/bin/env bash
# Installs Debian's chromium for the cluster tier's browser tests (tests/cluster/test_lineage_page.py
# runs it when `chromium` is missing). Idempotent: does nothing when chromium is on PATH already.
# Needs root (or passwordless sudo) and the Debian mirrors; exits non-zero saying why otherwise.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "install_chromium.sh: chromium is missing and this user cannot install packages (not root, no sudo)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq chromium
command -v chromium >/dev/null
