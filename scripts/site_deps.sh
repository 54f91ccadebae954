#!/usr/bin/env bash
# What the site's build and browser test need, installed when missing (called by tests/test_site.py):
#   scripts/site_deps.sh npm       npm ci --prefix visualizer-web (the pinned TypeScript + esbuild)
#   scripts/site_deps.sh chromium  a headless-capable Chromium: $CHROME, one on PATH, else Debian's chromium
#                                  (apt-get, as root or with password-less sudo)
# Prints the path / what it did on stdout; on failure says why on stderr and exits 3 (the test skips
# with that reason).
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  npm)
    if [ -x visualizer-web/node_modules/.bin/esbuild ] && [ -x visualizer-web/node_modules/.bin/tsc ]; then
      echo "visualizer-web/node_modules"; exit 0
    fi
    command -v npm >/dev/null 2>&1 || { echo "npm not found: install Node.js 20+ to build the site" >&2; exit 3; }
    npm ci --prefix visualizer-web --no-audit --no-fund --loglevel=error >&2 \
      || { echo "npm ci --prefix visualizer-web failed (no registry access?)" >&2; exit 3; }
    echo "visualizer-web/node_modules" ;;
  chromium)
    # $CHROME wins; then Debian's chromium; then what CI images ship (Ubuntu's apt chromium is a snap stub)
    # (a candidate must answer --version: a snap stub without snapd does not)
    if [ -n "${CHROME:-}" ] && [ -x "$CHROME" ]; then echo "$CHROME"; exit 0; fi
    for b in chromium chromium-browser google-chrome google-chrome-stable; do
      if command -v "$b" >/dev/null 2>&1 && timeout 60 "$b" --version >/dev/null 2>&1; then command -v "$b"; exit 0; fi
    done
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
      echo "chromium is not installed and apt-get needs root (run: sudo apt-get install -y chromium)" >&2; exit 3
    fi
    command -v apt-get >/dev/null 2>&1 || { echo "chromium is not installed and this system has no apt-get" >&2; exit 3; }
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; } >&2 </dev/null \
      || { echo "apt-get install chromium failed (no package archive access?)" >&2; exit 3; }
    command -v chromium || { echo "apt-get installed no chromium binary" >&2; exit 3; } ;;
  *)
    echo "usage: scripts/site_deps.sh npm|chromium" >&2; exit 2 ;;
esac
