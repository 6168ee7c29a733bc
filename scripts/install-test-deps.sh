#!/usr/bin/env bash
# What the tests need beyond `make install`: Debian's libibverbs1 (the Mooncake transfer engine
# links against it, even in TCP mode; without recommends: no RDMA providers are wanted here),
# Debian's prometheus (for `promtool check metrics`), redis-server and redis-sentinel (a replicated
# Redis), a C++ compiler and ninja (pdserve's CPU attention kernel is compiled on first use) and
# the Mooncake engine's CPU wheel.
# Idempotent; needs root (or sudo) for apt-get the first time.
set -euo pipefail
PY=${1:-.venv/bin/python}

missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v promtool >/dev/null || missing+=(prometheus)
command -v openssl >/dev/null || missing+=(openssl)  # test certificates for the admin TLS test
command -v g++ >/dev/null || missing+=(g++)
command -v ninja >/dev/null || missing+=(ninja-build)  # torch builds C++ extensions with it
# a replicated Redis (primary, replica, Sentinel) for the storage tier's failover tests
command -v redis-sentinel >/dev/null || missing+=(redis-server redis-sentinel)
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || { echo "error: ${missing[*]} missing and neither root nor sudo is available: apt-get install -y --no-install-recommends ${missing[*]}" >&2; exit 1; }
        SUDO=sudo
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
"$PY" -m pip install --quiet -c constraints.txt mooncake-transfer-engine-non-cuda
