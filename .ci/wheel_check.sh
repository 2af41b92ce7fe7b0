#!/usr/bin/env bash
# The wheel as a user gets it: `python -m build` makes the sdist and the wheel (the wheel built from the sdist, so
# the sdist is complete), a fresh virtual environment in a temporary folder installs the wheel with only its
# declared dependencies, and .ci/wheel_check.py, run there from outside the checkout, checks the installed package
# (metadata, every public module, the optional parts' errors, the console script, the README's first code block).
#   bash .ci/wheel_check.sh        (make wheel; PYTHON and TORCH as in the Makefile)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"   # on these machines 2.13.0 is a CPU build on local disk; any other downloads CUDA's
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== build (sdist, then the wheel from it)"
"$PYTHON" -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install --quiet --no-compile "build>=1.2"
"$work/build-env/bin/python" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ls -l "$work/dist"
mkdir -p dist && rm -f dist/lossscale-*
cp "$work"/dist/* dist/
echo "   built in $((SECONDS - start)) s; copies in dist/"

echo "== a fresh environment: the wheel and its declared dependencies only"
"$PYTHON" -m venv "$work/env"
"$work/env/bin/python" -m pip install --quiet --no-compile "$work"/dist/*.whl "$TORCH"
"$work/env/bin/python" -m pip list --format=freeze | sed 's/^/   /'

echo "== the installed package"
cp .ci/wheel_check.py README.md "$work/"
(cd "$work" && PATH="$work/env/bin:$PATH" "$work/env/bin/python" wheel_check.py "$work/dist" README.md)
echo "wheel check took $((SECONDS - start)) s"
