#!/usr/bin/env bash
# The formatter's check and the linter (ruff, configured in pyproject.toml), the test suite, then the tests
# marked `invariance` (results identical to the bit across layouts) a second time with ATen's CPU kernels
# forced to another family than this machine's: what holds on one kernel family must hold on the others.
# On a CPU that is not Intel's, they run a third time on MKL's Intel code path (scripts/mkl_intel_path.c,
# preloaded: MKL picks its kernels by the CPU's vendor too, and an Intel CI machine runs that path natively).
# Each pass runs on 2 pytest-xdist workers, a test module to a worker (its module fixtures built once): the
# suite is mostly one busy core at a time (Python, process start-up, waits), so 2 workers on the 2-core CI
# machine take about 0.6 of one's wall time. TEST_WORKERS=0 runs them in this process.
# Extra arguments go to the first pytest pass (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
lint_paths=(splitproof tests benchmarks scripts examples)
workers=(-n "${TEST_WORKERS:-2}" --dist loadscope)
"$python" -m ruff format --check "${lint_paths[@]}"
"$python" -m ruff check "${lint_paths[@]}"
"$python" -m pytest "${workers[@]}" "$@"
capability=$("$python" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
case "$capability" in
    AVX512*) other=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2) ;;
    *) other=(ATEN_CPU_CAPABILITY=default) ;;
esac
echo "invariance tests again, machine kernels $capability, now with ${other[*]}"
env "${other[@]}" "$python" -m pytest "${workers[@]}" -m "invariance and not slow"
if ! grep -q GenuineIntel /proc/cpuinfo; then
    shim_dir=$(mktemp -d)
    cc -shared -fPIC -O2 -o "$shim_dir/libmkl_intel_path.so" scripts/mkl_intel_path.c
    echo "invariance tests again on MKL's Intel code path (LD_PRELOAD=$shim_dir/libmkl_intel_path.so)"
    LD_PRELOAD="$shim_dir/libmkl_intel_path.so" "$python" -m pytest "${workers[@]}" -m "invariance and not slow"
    rm -r "$shim_dir"
fi
