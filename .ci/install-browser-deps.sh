#!/usr/bin/env bash
# What tests/test_browser.py needs: Debian's chromium and Playwright's Python package to drive it.
# Never `playwright install`: it downloads its own browser, which this environment cannot fetch;
# the test launches /usr/bin/chromium through executable_path instead.
set -euo pipefail

if [ ! -x /usr/bin/chromium ]; then
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo "sudo")
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
fi
# Playwright comes with the test extra (pip install -e '.[test]'); install it here only into an
# active virtual environment (the system Python is externally managed).
if [ -n "${VIRTUAL_ENV:-}" ]; then
    python -m pip install --quiet "playwright>=1.45"
fi
/usr/bin/chromium --version
