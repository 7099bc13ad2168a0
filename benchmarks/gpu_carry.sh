#!/usr/bin/env bash
# Prepare, on this machine, what a device lease needs to carry to the GPU machine, which has
# torch but no hydra, omegaconf, soundfile, SpeechBrain or flashlight-text, no FSDD and no
# network: the wheels of ../shared/wheels-py312 plus flashlight-text (the lexicon decoder)
# into .whl/, and the FSDD recordings into .fsdd/ (both git-ignored; ~33 MB together, under a
# call's 64 MiB). Then run benchmarks/gpu_lease.sh there, carrying both:
#   bash benchmarks/gpu_carry.sh
#   device run: carry [".whl", ".fsdd"], command "bash benchmarks/gpu_lease.sh", timeout_s 590
# Re-running is cheap: what is already in place is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
FSDD=${FSDD_ROOT:-$SHARED/datasets/fsdd}
mkdir -p .whl
cp -u "$SHARED"/wheels-py312/*.whl .whl/
if ! ls .whl/flashlight_text-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .whl flashlight-text || echo "flashlight-text not downloaded: the sweep decodes greedily"
fi
if [ ! -d .fsdd/recordings ]; then
  rm -rf .fsdd.tmp && mkdir -p .fsdd.tmp && cp -r "$FSDD"/. .fsdd.tmp/ && mv .fsdd.tmp .fsdd
fi
git describe --always --dirty > .whl/commit.txt  # the code the lease runs (no .git there)
du -sh .whl .fsdd
echo 'carry: [".whl", ".fsdd"]   command: bash benchmarks/gpu_lease.sh   (PARTS=... to choose)'
