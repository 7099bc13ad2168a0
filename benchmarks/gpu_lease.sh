#!/usr/bin/env bash
# Run on the lent GPU machine (after benchmarks/gpu_carry.sh here, carrying .whl and .fsdd):
# installs the carried wheels into /tmp/site, puts them and this checkout on PYTHONPATH,
# points FSDD_ROOT at .fsdd and runs benchmarks/run_gpu.sh with its defaults (one command
# inside the 10-minute limit; PARTS, DEADLINE and the other knobs pass through), keeping
# its summary and tarball in $OUT. LEASE_INSTALL=0 skips the install (a CPU dry run here).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${LEASE_INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export FSDD_ROOT=${FSDD_ROOT:-$PWD/.fsdd}
export OUT=${OUT:-benchmarks/out}
export WORK=${WORK:-/tmp/gpu_work}  # checkpoints stay on the machine; $OUT gets the summary
python3 -c "import hydra, omegaconf, soundfile, torch; print('torch', torch.__version__)" || exit 1
mkdir -p "$OUT"
cp .whl/commit.txt "$OUT/commit.txt" 2>/dev/null || git describe --always --dirty > "$OUT/commit.txt"
bash benchmarks/run_gpu.sh
