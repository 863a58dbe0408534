#!/usr/bin/env bash
# The verifiers lane: tests/test_verifiers_env.py in a venv of its own with verifiers 0.3.x (its classic API),
# on top of the main venv's packages (a .pth file), so installing verifiers never changes torch or
# transformers there. Run after the main suite: scripts/test_verifiers.sh (PYTHON: the main venv's python).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
lane=${VERIFIERS_VENV:-.venv-verifiers}
site=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ ! -x "$lane/bin/python" ]; then
    "$python" -m venv --without-pip "$lane" 2>/dev/null || "$python" -m venv "$lane"
    "$lane/bin/python" -m ensurepip -q 2>/dev/null || true
    echo "$site" > "$("$lane/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/main_venv.pth"
    "$lane/bin/python" -m pip install -q 'verifiers>=0.3.1,<0.4'
fi
"$lane/bin/python" -c "import torch, transformers, verifiers; print('verifiers lane: torch', torch.__version__, 'transformers', transformers.__version__, 'verifiers', verifiers.__version__)"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$lane/bin/python" -m pytest tests/test_verifiers_env.py -q -p no:cacheprovider
