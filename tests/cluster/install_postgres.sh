#!/usr/bin/env bash
# Installs Debian's postgresql for the cluster tier's tracking-store tests (tests/helpers/postgres.py
# runs it when no initdb is found). Idempotent: does nothing when PostgreSQL's server binaries are
# there already. The tests start their own throwaway server; this only installs the binaries.
# Needs root (or passwordless sudo) and the Debian mirrors; exits non-zero saying why otherwise.
set -euo pipefail
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "install_postgres.sh: PostgreSQL is missing and this user cannot install packages (not root, no sudo)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends postgresql
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
