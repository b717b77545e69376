#!/usr/bin/env bash
# Screenshot the first screen (1280 x 900) of a report.html with headless Chromium.
#   scripts/screenshot_report.sh RUN_DIR/report.html docs/report-first-screen.png
# Chromium: `apt-get install chromium` on Debian (chromium-browser or google-chrome also work).
set -euo pipefail
report="${1:?usage: $0 REPORT_HTML OUT_PNG}"
out="${2:?usage: $0 REPORT_HTML OUT_PNG}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [[ -z "$browser" ]]; then
  echo "screenshot_report.sh: no chromium found (Debian: apt-get install chromium)" >&2
  exit 2
fi
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
url="file://$(cd "$(dirname "$report")" && pwd)/$(basename "$report")"
mkdir -p "$(dirname "$out")"
out_abs="$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --hide-scrollbars --user-data-dir="$profile" --window-size=1280,900 \
  --screenshot="$out_abs" "$url" 2>/dev/null
test -s "$out_abs" && echo "$out_abs"
