#!/usr/bin/env bash
# Installs Debian's softhsm2 (a PKCS#11 token in software) for the cluster tier's PKCS#11 signer
# tests (tests/cluster/test_pkcs11_signer.py runs it when libsofthsm2.so is missing). Idempotent:
# does nothing when the library is there already. The tests make their own throwaway token.
# Needs root (or passwordless sudo) and the Debian mirrors; exits non-zero saying why otherwise.
set -euo pipefail
if [ -e /usr/lib/softhsm/libsofthsm2.so ] && command -v softhsm2-util >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "install_softhsm.sh: SoftHSM2 is missing and this user cannot install packages (not root, no sudo)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends softhsm2
test -e /usr/lib/softhsm/libsofthsm2.so
