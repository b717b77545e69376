#!/usr/bin/env bash
# What the tests exercise beyond the Python packages of `pip install -e ".[test]"`, from Debian's
# (or Ubuntu's) packages: a single-node SLURM cluster (slurm-wlm, munge: tests/test_slurm.py),
# the allocators jemalloc and tcmalloc (the allocator technique), headless Chromium (the
# report's page width). Run as root on a Debian-like machine (CI); elsewhere it says what it
# left out and ends well, and the tests that need those packages are skipped with the reason.
set -euo pipefail
PACKAGES="slurm-wlm munge libjemalloc2 libgoogle-perftools4 chromium"
say() { echo "install-test-deps: $*" >&2; }
if ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
  say "no apt-get here: not installed ($PACKAGES); the tests that need them are skipped"
  exit 0
fi
missing=$(for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
if [ -z "$missing" ]; then
  say "all present ($PACKAGES)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  say "not root: not installed ($(echo $missing)); the tests that need them are skipped" \
      "(as root: apt-get install $(echo $missing))"
  exit 0
fi
apt-get update -qq
# policy-rc.d (containers) or no systemd: no daemon is started; the tests start their own
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
say "installed $(echo $missing)"
