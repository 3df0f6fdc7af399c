#!/usr/bin/env bash
# usage: mkwt.sh NAME  -> /work/wt/NAME on branch NAME with its own light venv
set -euo pipefail
name=$1
cd /work/main
git worktree add -q /work/wt/$name -b $name main
cd /work/wt/$name
python3 -m venv --without-pip .venv
echo /work/main/.venv/lib/python3.11/site-packages > .venv/lib/python3.11/site-packages/_main_site.pth
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING || true
touch .venv/.installed
.venv/bin/python -c "import jmegatron, jmegatron.kernels, jmegatron.export; print(jmegatron.__file__, jmegatron.kernels.__file__)"
