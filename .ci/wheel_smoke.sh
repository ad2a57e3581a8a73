#!/usr/bin/env bash
# The wheel as a user gets it: build the sdist and wheel, install the wheel into a fresh virtual
# environment and run it from a directory outside the source tree: import, `python -m launch
# --help`, a 20-step tiny train and its evaluation. Usage: .ci/wheel_smoke.sh DEPS_SITE_PACKAGES
# DEPS_SITE_PACKAGES: an environment that already holds fibjax's dependencies (CI's), read through
# a path in a .pth file, so the smoke test adds no download; that path does not run the editable
# fibjax's own .pth finder, so only the wheel's fibjax and launch can be imported.
set -euo pipefail
deps="$1"
cd "$(dirname "$0")/.."
rm -rf dist
python -m build --outdir dist . >/dev/null
ls dist/fibjax-*.tar.gz dist/fibjax-*-py3-none-any.whl
smoke="$(mktemp -d)"
trap 'rm -rf "$smoke"' EXIT
python -m venv "$smoke/venv"
site="$("$smoke/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$deps" > "$site/ci-dependencies.pth"
# --no-index: every dependency the wheel declares must already be there, at a version it accepts
"$smoke/venv/bin/pip" install --quiet --no-index dist/fibjax-*-py3-none-any.whl
cd "$smoke"
py="$smoke/venv/bin/python"
"$py" -c "import fibjax, launch, sys; assert fibjax.__file__.startswith('$site') and launch.__file__.startswith('$site'), (fibjax.__file__, launch.__file__)"
"$py" -m launch --help
# the default config (configs/tiny.py) and --config configs/... resolve inside the wheel
"$py" -m launch.train --workdir runs/smoke --no-progress steps=20 eval.every_steps=0 eval.at_end=false checkpoint.every_steps=20 mesh.devices=1
"$py" -m launch.eval --workdir runs/smoke --lengths 256,512
test -f runs/smoke/eval/20-len_256_512.json
"$py" -m launch.plan --config configs/cpu/dense.py --no-compile --devices 8 >/dev/null
echo "wheel smoke test: passed"
