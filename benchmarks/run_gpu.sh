#!/usr/bin/env bash
# Reproduces the GPU measurements in benchmarks/results/: GPU tests, precision sweeps of
# both recipes and the step benchmark. Run from the repo root on a CUDA machine with the
# project importable (pip install -e . or PYTHONPATH=.) and FSDD_ROOT set.
# Time limits (seconds) and sizes come from the environment so a short lease can run it.
set -u
OUT=${OUT:-benchmarks/out}
EPOCHS_ASR=${EPOCHS_ASR:-30}     # epochs of each ASR run
EPOCHS_SPK=${EPOCHS_SPK:-15}     # epochs of each speaker-ID run (0: skip)
RUN_LIMIT=${RUN_LIMIT:-85}       # time limit of one training run
BENCH_STEPS=${BENCH_STEPS:-30}   # timed steps per benchmark measurement
TEST_LIMIT=${TEST_LIMIT:-70}     # time limit of the GPU tests
BENCH_LIMIT=${BENCH_LIMIT:-150}  # time limit of the step benchmark
PROFILE_STEPS=${PROFILE_STEPS:-3}  # torch.profiler summary of N steps per mode (0: off)
COMPILE_LIMIT=${COMPILE_LIMIT:-0}  # > 0: also benchmark trainer.compile=true within this limit
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
date -u +%Y-%m-%dT%H:%M:%SZ >> "$OUT/gpu.txt"
{ timeout "$TEST_LIMIT" python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -15; } > "$OUT/gpu_tests.txt"
# One precision per invocation (each with its own time limit) into one sweep folder;
# summarize_sweep below tabulates all of them, even if one was cut short.
for p in fp32 bf16 fp16; do
  timeout "$RUN_LIMIT" python3 recipes/train.py -m precision=$p device=cuda \
    trainer.epochs="$EPOCHS_ASR" trainer.noprogressbar=true hydra.sweep.dir="$OUT/sweep_asr" \
    >> "$OUT/sweep_asr.log" 2>&1
done
if [ "$EPOCHS_SPK" -gt 0 ]; then
  for p in fp32 bf16; do
    timeout "$RUN_LIMIT" python3 recipes/train.py -m precision=$p device=cuda model=xvector \
      trainer.epochs="$EPOCHS_SPK" trainer.noprogressbar=true hydra.sweep.dir="$OUT/sweep_spk" \
      >> "$OUT/sweep_spk.log" 2>&1
  done
fi
python3 -c "import sys, pathlib; from amp_utils.sweep_summary import summarize_sweep as s
[s(pathlib.Path(d)) for d in sys.argv[1:] if pathlib.Path(d).is_dir()]" \
  "$OUT/sweep_asr" "$OUT/sweep_spk"
timeout "$BENCH_LIMIT" python3 recipes/benchmark.py device=cuda benchmark.steps="$BENCH_STEPS" \
  benchmark.warmup_steps=8 benchmark.profile_steps="$PROFILE_STEPS" hydra.run.dir="$OUT/bench" \
  > "$OUT/bench.log" 2>&1
if [ "$COMPILE_LIMIT" -gt 0 ]; then
  timeout "$COMPILE_LIMIT" python3 recipes/benchmark.py device=cuda trainer.compile=true \
    benchmark.steps="$BENCH_STEPS" benchmark.warmup_steps=8 benchmark.modes=[bare,brain,staged] \
    benchmark.profile_steps="$PROFILE_STEPS" hydra.run.dir="$OUT/bench_compile" \
    > "$OUT/bench_compile.log" 2>&1
fi
tar czf "$OUT/runs.tgz" --exclude=checkpoints --exclude='*.tfevents*' -C "$OUT" \
  bench bench_compile sweep_asr sweep_spk 2>/dev/null
echo done
