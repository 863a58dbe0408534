#!/usr/bin/env bash
# The formatter's check and the linter (ruff, configured in pyproject.toml), the test suite, then the tests
# marked `invariance` (results identical to the bit across layouts) a second time with ATen's CPU kernels
# forced to another family than this machine's: what holds on one kernel family must hold on the others.
# On a CPU that is not Intel's, they run a third time on MKL's Intel code path (scripts/mkl_intel_path.c,
# preloaded: MKL picks its kernels by the CPU's vendor too, and an Intel CI machine runs that path natively).
# Extra arguments go to the first pytest pass (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
lint_paths=(splitproof tests benchmarks scripts examples)
"$python" -m ruff format --check "${lint_paths[@]}"
"$python" -m ruff check "${lint_paths[@]}"
"$python" -m pytest "$@"
capability=$("$python" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
case "$capability" in
    AVX512*) other=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2) ;;
    *) other=(ATEN_CPU_CAPABILITY=default) ;;
esac
echo "invariance tests again, machine kernels $capability, now with ${other[*]}"
env "${other[@]}" "$python" -m pytest -m "invariance and not slow"
if ! grep -q GenuineIntel /proc/cpuinfo; then
    shim_dir=$(mktemp -d)
    cc -shared -fPIC -O2 -o "$shim_dir/libmkl_intel_path.so" scripts/mkl_intel_path.c
    echo "invariance tests again on MKL's Intel code path (LD_PRELOAD=$shim_dir/libmkl_intel_path.so)"
    LD_PRELOAD="$shim_dir/libmkl_intel_path.so" "$python" -m pytest -m "invariance and not slow"
    rm -r "$shim_dir"
fi
