#!/usr/bin/env bash
# Everything measured on a GPU, in parts that run in the order PARTS lists them (default:
# the order below):
#   bench_graphs       step benchmark of the default small recipe with fast_path=step_graphs
#                      (each batch shape's whole step captured as one CUDA graph), with a
#                      torch.profiler summary of 3 more steps per row (why a target is missed)
#   bench_graphs_brain bench_graphs' fp32 and bf16 Brain rows alone (the default options)
#   bench_graphs_unfused  bench_graphs' bf16 Brain row with precision.fused_weight_casts=false:
#                      autocast's own per-weight casts, the A/B of the casts made together
#   bench_graphs_low_norms  bench_graphs' bf16 Brain row with precision.low_precision_norms=true
#                      (with the weights cast together: 1.02x fp32's operations, counted on a CPU)
#   graph_tests        pytest -m gpu of the weights cast together (fused_weight_casts, the
#                      default since 3766fcf), the whole-step graphs, the device-side CTC loss,
#                      the CUDA kernels (fast_kernels) and the Brain's CUDA tests (background saves)
#   default_runs       the README's command as a user runs it (python recipes/train.py -m
#                      precision=fp32,bf16 device=cuda: the default recipe with its default
#                      fast_path=auto, i.e. whole-step graphs), one precision after the
#                      other: test CER/WER and end-to-end speed of each
#   sweep              experiment=gpu_asr training for bf16, fp16, fp32 at once: test WER after
#                      the same steps (sweep_<p>: one precision alone)
#   bench_small        step benchmark of the default small recipe with fast_path=cuda_graphs
#   bench_graphs_compiled  bench_graphs with the encoder blocks compiled (inductor's fused
#                      kernels inside the captured step): fp32, bf16
#   bench_m_graphs     bench_m's model and batches with fast_path=step_graphs and the blocks
#                      compiled (on the H100, LayerNorm and casts were most of an eager bf16
#                      Conformer-M step, and inductor fuses them): fp32, TF32, bf16 x
#                      bare/brain/staged
#   bench_m_norm_saves bench_m_graphs' bf16 Brain and staged rows with
#                      precision.norm_saves_16bit=false, then true (time and peak memory of
#                      LayerNorms that keep a bf16 normalized input for backward: A/B)
#   bench_m_depthwise  bench_m_graphs' bf16 Brain row with device.cuda_depthwise=torch, cudnn, unfold
#                      (the Conformer's depthwise convolutions channels-last, run by cuDNN:
#                      PyTorch's own depthwise kernels took ~6 ms of each step on 2026-11-27)
#   bench_peers        bench_graphs' bf16 Brain row against SpeechBrain's Brain and Lightning's
#                      Trainer in bf16 on the same model and batches (ours >= 1.3x theirs?)
#   bench_m            step benchmark of experiment=gpu_asr (Conformer-M, 25.6 M parameters):
#                      fp32, fp32+TF32, bf16, fp16 x bare/brain/staged/loader, peers in bf16
#   activation_memory  recipes/diagnose.py on experiment=gpu_asr in bf16 with the sweep's
#                      batches: what the backward pass keeps under fp32 and bf16, by dtype and
#                      module (why bf16's peak memory was 0.63x fp32's, target 0.6x), and
#                      the step's operations under CUDA's autocast, casts sorted
#   gpu_tests          pytest -m gpu
#   bench_small_eager  the small recipe without the fast path
# Each part runs under its own time limit inside one deadline; what a part finished is kept.
# A lease is 15 minutes of device time, the machine's start (1-2 min) included, and a command
# at most 10 minutes: the default DEADLINE fits one command, and the default PARTS puts first
# what no lease has measured yet. The third 2026-11-27 H200 lease (commit 9892d1b,
# benchmarks/results/2026-11-27-h200-evening.md) met Conformer-M's speed targets (bench_m_graphs:
# bf16 3.62x fp32 and 1.98x TF32, fp16 3.61x; peak 0.70x, target 0.6x missed), loader/staged
# 0.99 (bf16) / 0.94 (fp16), default_runs rc 0 at 1.11x (target 1.2x missed; validation and
# epoch ends ~0.1 s and ~20 ms an epoch now), and found the sweep's fp32 run stuck on the CTC
# plateau: the batch order (4e1e480) decided it; experiment=gpu_asr now trains its first epoch
# shortest bucket first (data.ascending_epochs=1, SortaGrad; CPU: validation CER 7-8 % at step
# 160 in seeds 1 and 2). bench_graphs_unfused ran bf16 at the fused row's speed with 780
# against 950 MB peak: under whole-step graphs casting the weights together saved no time.
# Next lease (~900 s with the start), in this order:
#   command 1: DEADLINE=560 PARTS="sweep graph_tests" SWEEP_PRECISIONS="fp32 bf16 fp16 bf16_norm_saves"
#     (the sweep with SortaGrad: every precision should leave the plateau, test WER within
#     0.5 points of fp32; bf16_norm_saves: precision.norm_saves_16bit, autocast's forward
#     with 16-bit normalized LayerNorm inputs kept for backward; the sweep's blocks are
#     compiled, and counted compiled on a CPU (activation_memory_cuda_policy.py --compiled,
#     2026-11-28-cpu-compiled-activation-memory.md) it keeps 0.60x fp32 with the training
#     state against plain bf16's 0.64x (the sweep's bf16 run peak was 0.63x; before 09bdd98
#     inductor folded the option's casts and it kept as much as plain bf16): its run peak
#     against fp32's is the 0.6x memory target's next reading;
#     four runs share the GPU, ~300-380 s; graph_tests now also runs test_brain.py's CUDA
#     tests, the fixed unfold/cuDNN depthwise tests and test_saved_activations.py's);
#   command 2: PARTS="default_runs bench_graphs" DEFAULT_EXTRA="precision.fused_weight_casts=false"
#     (2026-11-28: the device CTC loss gathers its frames' gradients with one stack, ~3 kernels
#     a frame fewer in every captured step of the small recipe: its steps/s against the
#     2026-11-27 evening rows 105.25 fp32 / 147.51 bf16, and default_runs' 1.11x) and
#     PARTS="bench_m_norm_saves activation_memory" (norm_saves_16bit's time cost on Conformer-M
#     against the plain bf16 row of the same part (bench_m_graphs' was 45.32 bf16 steps/s
#     with the features compiled too, before 2026-11-28): compiled, each fp32-input LayerNorm is an
#     opaque operation that inductor cannot fuse with the add before it and the cast after
#     it, 64 a step; and the saved bytes of the LayerNorm variants, eager and, new on
#     2026-11-28, compiled as the sweep compiles them: each run compiles twice, so with
#     little time left use ACT_MEM_NORMS="false saves"; PARTS=sweep
#     SWEEP_PRECISIONS="bf16_low_norms" if time is left).
#     Also new since that lease (8fc50db): a shape new after the first capture warms up with
#     one eager step (trainer.graph_step_later_warmup=1), so default_runs' step_graphs should
#     read ~11 eager steps, not 20; the evening's steady epochs 4-30 were 224 ms (fp32) and
#     240 ms (bf16) wall each, validation 77 / 107 ms of them (eager: bf16 pays autocast's
#     launches), training ~130 / ~112 ms; its 1.11x came from epochs 2-30, and epochs 2-3
#     (the captures of 9 shapes and their 18 eager steps) took ~0.9 s of bf16's 4.2 s.
#     Validation now replays CUDA graphs too (trainer.graph_eval, c691ec3): default_runs'
#     epoch_split.md should show it at ~20-30 ms an epoch, and results.json eval_graphs;
#     graph_tests runs test_captured_validation_scores_as_eager_validation_on_cuda.
# activation_memory (~30 s, new on 2026-11-26) tests a prediction: on CUDA autocast runs
# every LayerNorm in fp32 and each keeps an fp32 input for backward (the residual stream is
# fp32 from block 1 on, as each block's final LayerNorm outputs fp32; the conv module's
# second norm upcasts a bf16 input), 6 per Conformer block, about a fifth of bf16's saved
# bytes by a count of the block's saves; LayerNorms on bf16 copies of their inputs (fp32
# statistics inside the kernel: precision.low_precision_norms=true, off by default) would
# bring the 0.63x towards 0.55x. The part diagnoses both; the accuracy needs a sweep.
# (Measured 2026-11-27: 0.64x / 0.55x of saved bytes, 0.68x / 0.60x with the fp32 state; the
# CPU count with CUDA's bool dropout masks predicts 0.67x / 0.59x: 2026-11-28-cpu-activation-memory.md.)
# That sweep: PARTS=sweep SWEEP_PRECISIONS="bf16 bf16_low_norms fp32" (the three train at once,
# ~300 s; compare test WER in sweep_gpu_asr/summary.md). With the weights cast together
# (default since 3766fcf) low_precision_norms also brings bf16's step to 1.01-1.02x fp32's
# operation count (counted on a CPU: benchmarks/results/2026-11-26-cpu-kernel-count.md).
# Timings on the H200: bench_graphs 68-72 s; graph_tests 113 s (2026-11-27, 4 of 11 failing early);
# the sweep 272 s (1500 steps); bench_m_graphs ~60 s per variant (fp32, TF32, bf16: the
# first compile of each); bench_small ~65 s per precision; bench_m's fp32 and TF32 rows
# ~117 s; gpu_tests 20 of 26 in 85 s.
# Run from the repo root with the project importable
# (pip install -e . or PYTHONPATH=.) and FSDD_ROOT set. The lent GPU machine lacks
# flashlight-text (the lexicon decoder, a core dependency; the GPU tests train with it):
# carry its cp312 wheel with ../shared/wheels-py312 (see the sweep part for the download
# command). The parts write into $WORK; $OUT keeps a summary and a tarball of $WORK without
# checkpoints.
# The sizes come from the environment so that a CPU dry run (DEVICE=cpu and tiny *_EXTRA
# overrides) checks the whole script in minutes.
# CPU dry run, every part in ~3 min on 2 cores (2026-11-26; the small parts stop at their limits):
#   DEVICE=cpu BENCH_STEPS=2 M_BATCH=4 BENCH_UTTS=300 TRAIN_UTTS=200 TRAIN_BATCH=20 TRAIN_EPOCHS=1 \
#   TRAIN_WARMUP=5 TRAIN_WORKERS=0 BENCH_WORKERS=0 SWEEP_PRECISIONS="fp32 bf16" \
#   M_EXTRA="model.d_model=32 model.num_layers=1 model.num_heads=2 model.ffn_dim=64 trainer.compile=false data.num_valid=20 data.num_test=20" \
#   SMALL_EXTRA="benchmark.batch_size=4 trainer.compile=false" OUT=/tmp/gpu_dry bash benchmarks/run_gpu.sh
set -u
OUT=${OUT:-benchmarks/out}         # what to keep: parts.txt, summary.md, results_*.tgz
WORK=${WORK:-$OUT}                 # where the parts write (checkpoints, logs, tables)
DEVICE=${DEVICE:-cuda}
DEADLINE=${DEADLINE:-560}          # seconds for the whole script (one command: at most 600)
BENCH_STEPS=${BENCH_STEPS:-20}     # timed steps per benchmark row
M_BATCH=${M_BATCH:-96}             # synthetic batch of the Conformer-M benchmark (x 4 s)
BENCH_UTTS=${BENCH_UTTS:-8000}     # generated training utterances behind the benchmark's real batches
                                   # (~40 batches an epoch: the warm-up and timed steps stay inside one
                                   # epoch, as most of training's 330-step epochs do; 3000 gave ~15)
TRAIN_UTTS=${TRAIN_UTTS:-20000}    # generated training utterances of the sweep (~14 h)
TRAIN_BATCH=${TRAIN_BATCH:-100}    # data.max_batch_seconds of the sweep (x 2 on CUDA)
TRAIN_EPOCHS=${TRAIN_EPOCHS:-5}    # epochs of each sweep run (~300 optimizer steps each; 288 s on the H200)
TRAIN_WARMUP=${TRAIN_WARMUP:-300}  # model.warmup_steps of the sweep
TRAIN_WORKERS=${TRAIN_WORKERS:-4}  # device.num_workers of each sweep run (3 run at once)
SWEEP_PRECISIONS=${SWEEP_PRECISIONS:-"bf16 fp16 fp32"}
SWEEP_PARALLEL=${SWEEP_PARALLEL:-1} # 1: the sweep's precisions train at once (accuracy only)
SWEEP_LIMIT=${SWEEP_LIMIT:-400}    # seconds for the sweep (each run, if not parallel)
M_MODES=${M_MODES:-[bare,brain,staged,loader,speechbrain,lightning]}  # modes of bench_m
BENCH_WORKERS=${BENCH_WORKERS:-4}  # device.num_workers behind bench_m's loader rows
BENCH_M_LIMIT=${BENCH_M_LIMIT:-260}         # seconds for bench_m
M_GRAPHS_PRECISIONS=${M_GRAPHS_PRECISIONS:-[fp32,bf16,fp16]}  # of bench_m_graphs (fp32 brings TF32 too)
M_DEPTHWISE_PRECISIONS=${M_DEPTHWISE_PRECISIONS:-[bf16]}  # of bench_m_depthwise (each run: these)
M_DEPTHWISE_WAYS=${M_DEPTHWISE_WAYS:-"torch cudnn unfold"}  # device.cuda_depthwise values, in order
BENCH_M_NORM_SAVES_LIMIT=${BENCH_M_NORM_SAVES_LIMIT:-100}  # each of its two bf16 Brain and staged rows (~60 s: the compile; not measured yet)
BENCH_M_DEPTHWISE_LIMIT=${BENCH_M_DEPTHWISE_LIMIT:-90}  # seconds for each of its runs (~60 s: the compile)
BENCH_M_GRAPHS_LIMIT=${BENCH_M_GRAPHS_LIMIT:-290}  # seconds for bench_m_graphs (4 variants, ~45-95 s each; 186 s for 3 on 2026-11-27)
BENCH_SMALL_LIMIT=${BENCH_SMALL_LIMIT:-200}  # seconds for bench_small (~65 s per precision, its compile)
BENCH_GRAPHS_LIMIT=${BENCH_GRAPHS_LIMIT:-120}  # seconds for bench_graphs (72 s on the H200 with 30 timed steps; ~15 s more with SMALL_STEPS=120)
BENCH_GRAPHS_UNFUSED_LIMIT=${BENCH_GRAPHS_UNFUSED_LIMIT:-45}  # one bf16 row (not measured yet)
BENCH_GRAPHS_BRAIN_LIMIT=${BENCH_GRAPHS_BRAIN_LIMIT:-60}  # fp32 and bf16 Brain rows (~25 s each)
BENCH_GRAPHS_LOW_NORMS_LIMIT=${BENCH_GRAPHS_LOW_NORMS_LIMIT:-45}  # one bf16 row (not measured yet)
BENCH_PEERS_LIMIT=${BENCH_PEERS_LIMIT:-90}  # our bf16 Brain row and the two peers' (not measured yet)
BENCH_GRAPHS_COMPILED_LIMIT=${BENCH_GRAPHS_COMPILED_LIMIT:-140}  # fp32 and bf16, ~65 s each (compile)
GRAPH_TESTS_LIMIT=${GRAPH_TESTS_LIMIT:-190}    # seconds for graph_tests (96 s before its compiled-blocks test; 113 s on 2026-11-27; + the validation-graph tests)
GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-130}     # seconds for gpu_tests
DEFAULT_RUNS_LIMIT=${DEFAULT_RUNS_LIMIT:-200}  # seconds for default_runs (not measured yet)
DEFAULT_PRECISIONS=${DEFAULT_PRECISIONS:-fp32,bf16}  # precisions of default_runs, in order
DEFAULT_EXTRA=${DEFAULT_EXTRA:-}   # extra overrides for default_runs (dry runs: fewer epochs)
ACT_MEM_LIMIT=${ACT_MEM_LIMIT:-150} # seconds for each of activation_memory's runs (not measured yet)
ACT_MEM_NORMS=${ACT_MEM_NORMS:-"false saves true"}  # its LayerNorm variants (true: low_precision_norms)
ACT_MEM_COMPILE=${ACT_MEM_COMPILE:-true}  # also count the blocks compiled as the sweep compiles them
GPU_TEST_FILES=${GPU_TEST_FILES:-}          # test files of gpu_tests, in this order (default: all)
GRAPH_TESTS_K=${GRAPH_TESTS_K:-}   # pytest -k expression of graph_tests (default: all of them)
M_EXTRA=${M_EXTRA:-}               # extra overrides for bench_m and sweep (dry runs: a tiny model)
SMALL_EXTRA=${SMALL_EXTRA:-}       # extra overrides for bench_small(_eager)
SMALL_PRECISIONS=${SMALL_PRECISIONS:-[fp32,bf16,fp16]}      # precisions of bench_small
SMALL_MODES=${SMALL_MODES:-[bare,brain,staged,loader]}    # modes of bench_small
SMALL_STEPS=${SMALL_STEPS:-120}    # timed steps per row of the small recipe's benchmarks (a graphed
                                   # step is ~6 ms: 30 steps timed ~0.2 s, too short to tell
                                   # loader/staged 0.94 from the 0.95 target; 120 cover 6 epochs)
# the parts to run, in this order (sweep: the precisions at once; sweep_<p>: one precision);
# what the deadline cuts is reported as skipped
PARTS=${PARTS:-"default_runs bench_graphs graph_tests bench_m_graphs sweep bench_graphs_unfused bench_graphs_low_norms bench_m_depthwise bench_peers activation_memory bench_graphs_compiled bench_m gpu_tests bench_small"}
mkdir -p "$OUT" "$WORK"
# A second command on the same warm machine shares $WORK (sweeps resume from their
# checkpoints there): its summary lists only what this command wrote (newer than STAMP).
STAMP="$WORK/.command_start"
touch "$STAMP"
: > "$WORK/parts.txt"
fresh() { [ -f "$1" ] && [ "$1" -nt "$STAMP" ]; }
export PYTHONUNBUFFERED=1
START=$SECONDS
left() { echo $((DEADLINE - (SECONDS - START))); }

# run_part NAME LIMIT COMMAND...: run with min(LIMIT, time left); log to $WORK/NAME.log
run_part() {
  local name=$1 limit=$2 remaining
  shift 2
  remaining=$(left)
  ((limit > remaining)) && limit=$remaining
  if ((limit < 15)); then
    echo "$name: skipped (deadline)" | tee -a "$WORK/parts.txt"
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$WORK/parts.txt"
}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || lscpu | head -20
  python3 -c "import torch; print('torch', torch.__version__)"
} > "$WORK/machine.txt"

# bench_m_run NAME LIMIT OVERRIDES...: a step benchmark of experiment=gpu_asr (Conformer-M) on
# its synthetic and real batches; M_EXTRA comes last
bench_m_run() {
  local name=$1 limit=$2
  shift 2
  run_part "$name" "$limit" python3 recipes/benchmark.py experiment=gpu_asr device="$DEVICE" \
    benchmark.batch_size="$M_BATCH" benchmark.utterance_seconds=4 benchmark.steps="$BENCH_STEPS" \
    benchmark.warmup_steps=5 data.num_train="$BENCH_UTTS" data.num_buckets=4 \
    device.num_workers="$BENCH_WORKERS" "$@" $M_EXTRA hydra.run.dir="$WORK/$name"
}
# bench_small_run NAME LIMIT OVERRIDES...: a step benchmark of the default small recipe (no TF32
# baseline, SMALL_STEPS timed steps); SMALL_EXTRA comes last
bench_small_run() {
  local name=$1 limit=$2
  shift 2
  run_part "$name" "$limit" python3 recipes/benchmark.py device="$DEVICE" \
    benchmark.tf32_baseline=false benchmark.steps="$SMALL_STEPS" benchmark.warmup_steps=5 "$@" $SMALL_EXTRA \
    hydra.run.dir="$WORK/$name"
}
COMPILED_GRAPHS="trainer.compile=true trainer.compile_regions=true trainer.compile_mode=default"

# bench_m: speed, memory, peers; bench_m_graphs: with whole-step graphs and compiled blocks
part_bench_m() { bench_m_run bench_m "$BENCH_M_LIMIT" benchmark.modes="$M_MODES"; }
part_bench_m_graphs() {
  bench_m_run bench_m_graphs "$BENCH_M_GRAPHS_LIMIT" fast_path=step_graphs $COMPILED_GRAPHS \
    benchmark.precisions="$M_GRAPHS_PRECISIONS" benchmark.modes=[bare,brain,staged] \
    benchmark.profile_steps=3
}
# bench_m_norm_saves: bench_m_graphs' bf16 Brain and staged rows with precision.norm_saves_16bit
# false, then true (the LayerNorms keep a bf16 normalized input for backward; compiled, through
# an opaque operation): its time and peak against the plain row, A/B on one machine (since
# 2026-11-28 trainer.compile compiles the model only, not the features: the 2026-11-27 rows
# compiled both)
part_bench_m_norm_saves() {
  local saves
  for saves in false true; do
    bench_m_run "bench_m_norm_saves_$saves" "$BENCH_M_NORM_SAVES_LIMIT" fast_path=step_graphs \
      $COMPILED_GRAPHS precision.norm_saves_16bit=$saves benchmark.precisions=[bf16] \
      benchmark.tf32_baseline=false benchmark.modes=[brain,staged] benchmark.profile_steps=3
  done
}
# bench_m_depthwise: bench_m_graphs' Brain row in M_DEPTHWISE_PRECISIONS with each way of
# computing the depthwise convolutions (PyTorch's own kernels, cuDNN's, inductor's fused
# window sums): an A/B/C on one machine
part_bench_m_depthwise() {
  local how
  for how in $M_DEPTHWISE_WAYS; do
    bench_m_run "bench_m_depthwise_$how" "$BENCH_M_DEPTHWISE_LIMIT" fast_path=step_graphs \
      $COMPILED_GRAPHS device.cuda_depthwise=$how benchmark.precisions="$M_DEPTHWISE_PRECISIONS" \
      benchmark.tf32_baseline=false benchmark.modes=[brain] benchmark.profile_steps=3
  done
}

# the default small recipe: with the compiled fast path, with whole-step graphs (eager or
# compiled blocks inside), and without any fast path
part_bench_small() {
  bench_small_run bench_small "$BENCH_SMALL_LIMIT" fast_path=cuda_graphs \
    benchmark.precisions="$SMALL_PRECISIONS" benchmark.modes="$SMALL_MODES"
}
part_bench_graphs() {
  bench_small_run bench_graphs "$BENCH_GRAPHS_LIMIT" fast_path=step_graphs \
    benchmark.precisions="$SMALL_PRECISIONS" benchmark.modes="$SMALL_MODES" benchmark.profile_steps=3
}
part_bench_graphs_unfused() {
  bench_small_run bench_graphs_unfused "$BENCH_GRAPHS_UNFUSED_LIMIT" fast_path=step_graphs \
    precision.fused_weight_casts=false benchmark.precisions=[bf16] benchmark.modes=[brain] \
    benchmark.profile_steps=3
}
part_bench_graphs_brain() {
  bench_small_run bench_graphs_brain "$BENCH_GRAPHS_BRAIN_LIMIT" fast_path=step_graphs \
    benchmark.precisions=[fp32,bf16] benchmark.modes=[brain] benchmark.profile_steps=3
}
part_bench_graphs_low_norms() {
  bench_small_run bench_graphs_low_norms "$BENCH_GRAPHS_LOW_NORMS_LIMIT" fast_path=step_graphs \
    precision.low_precision_norms=true benchmark.precisions=[bf16] benchmark.modes=[brain] \
    benchmark.profile_steps=3
}
part_bench_graphs_compiled() {
  bench_small_run bench_graphs_compiled "$BENCH_GRAPHS_COMPILED_LIMIT" fast_path=step_graphs \
    $COMPILED_GRAPHS benchmark.precisions=[fp32,bf16] benchmark.modes="$SMALL_MODES" \
    benchmark.profile_steps=3
}
# bench_peers: our bf16 Brain step (whole-step graphs) against SpeechBrain's Brain and
# Lightning's Trainer in bf16 on the same small model, batches and optimizer (issue #10's
# "ours >= 1.3x the peers' bf16"; never measured on a GPU: bench_m's peers were cut)
part_bench_peers() {
  bench_small_run bench_peers "$BENCH_PEERS_LIMIT" fast_path=step_graphs \
    benchmark.precisions=[bf16] benchmark.modes=[brain,speechbrain,lightning]
}
part_bench_small_eager() {  # eager steps are ~5x a replay: 30 timed steps fit its 35 s
  SMALL_STEPS=30 bench_small_run bench_small_eager 35 fast_path=none benchmark.precisions=[fp32,bf16] \
    benchmark.modes=[brain,loader]
}

# default_runs: the default recipe trained as the README says, each precision alone on the GPU
part_default_runs() {
  run_part default_runs "$DEFAULT_RUNS_LIMIT" python3 recipes/train.py -m \
    precision="$DEFAULT_PRECISIONS" device="$DEVICE" trainer.noprogressbar=true $DEFAULT_EXTRA \
    hydra.sweep.dir="$WORK/default_runs"
  # each steady epoch's wall time split into training, validation and epoch ends
  python3 -m benchmarks.epoch_split "$WORK"/default_runs/*_precision=* \
    > "$WORK/default_runs/epoch_split.md" 2>&1
}

# activation_memory: the bytes autograd keeps for one of the sweep's batches, fp32 and bf16
# (eager: diagnose hooks every module), as trained, with precision.low_precision_norms
# (norms_true) and with precision.norm_saves_16bit (norms_saves). With ACT_MEM_COMPILE=true
# (the default) the diagnosis then compiles the blocks as the sweep does (experiment=gpu_asr's
# fast_path=cuda_graphs) and counts what they keep: activation_memory_compiled.md (a CPU
# count with CUDA's choices: bf16 0.59x fp32 plain, 0.55x with either option,
# benchmarks/results/2026-11-28-cpu-compiled-activation-memory.md). Two compiles of
# Conformer-M's block per run (fp32, bf16): ~15-40 s each on an H100.
part_activation_memory() {
  local norms low saves compiled=(fast_path=none trainer.compile=false)
  [ "$ACT_MEM_COMPILE" = true ] && compiled=()
  for norms in $ACT_MEM_NORMS; do
    low=false saves=false
    case $norms in
      true) low=true ;;
      saves) saves=true ;;
    esac
    run_part "activation_memory_norms_$norms" "$ACT_MEM_LIMIT" python3 recipes/diagnose.py \
      experiment=gpu_asr precision=bf16 precision.low_precision_norms=$low \
      precision.norm_saves_16bit=$saves device="$DEVICE" "${compiled[@]}" \
      diagnose.batches=1 data.num_train="$BENCH_UTTS" \
      data.max_batch_seconds="$TRAIN_BATCH" $M_EXTRA \
      hydra.run.dir="$WORK/activation_memory_norms_$norms"
  done
}

# gpu_tests: pytest -m gpu, with what time is left
part_gpu_tests() {
  run_part gpu_tests "$GPU_TESTS_LIMIT" python3 -m pytest -m gpu -v -p no:cacheprovider --no-header \
    $GPU_TEST_FILES
}

part_graph_tests() {
  run_part graph_tests "$GRAPH_TESTS_LIMIT" python3 -m pytest -m gpu -v -p no:cacheprovider \
    --no-header ${GRAPH_TESTS_K:+-k "$GRAPH_TESTS_K"} tests/test_weight_casts.py \
    tests/test_step_graphs.py tests/test_ctc_on_device.py tests/test_fast_kernels.py \
    tests/test_brain.py tests/test_saved_activations.py
}

# sweep: precision sweep of experiment=gpu_asr. The precisions train at the same time on the
# one GPU (SWEEP_PARALLEL=1, the default: a short lease fits enough steps for a trained
# model), each with the same data, seed and number of optimizer steps. This part measures
# accuracy only: their speeds share the GPU and are not comparable (bench_m measures speed).
# sweep_<p> (or SWEEP_PARALLEL=0) trains one precision alone.
# The lexicon decoder needs flashlight-text, which ../shared/wheels-py312 lacks: carry its
# cp312 wheel in .whl/ (pip download flashlight-text --python-version 3.12
# --only-binary=:all: --platform manylinux2014_x86_64 --no-deps -d .whl), else decode greedily.
DECODER=
python3 -c "import flashlight.lib.text" 2>/dev/null || DECODER=model.decoder=greedy
# An entry of SWEEP_PRECISIONS is a precision, <precision>_low_norms for the same run with
# precision.low_precision_norms=true, or <precision>_norm_saves with
# precision.norm_saves_16bit=true (their accuracy against the plain run: e.g.
# SWEEP_PRECISIONS="bf16 bf16_norm_saves fp32").
sweep_run() {  # sweep_run ENTRY: one training run of the sweep
  local precision=$1 norms=false saves=false
  case $1 in
    *_low_norms) precision=${1%_low_norms} norms=true ;;
    *_norm_saves) precision=${1%_norm_saves} saves=true ;;
  esac
  python3 recipes/train.py -m experiment=gpu_asr precision="$precision" \
    precision.low_precision_norms=$norms precision.norm_saves_16bit=$saves \
    device="$DEVICE" data.num_train="$TRAIN_UTTS" data.max_batch_seconds="$TRAIN_BATCH" \
    trainer.epochs="$TRAIN_EPOCHS" model.warmup_steps="$TRAIN_WARMUP" trainer.noprogressbar=true \
    device.num_workers="$TRAIN_WORKERS" $DECODER $M_EXTRA \
    hydra.sweep.dir="$WORK/sweep_gpu_asr" hydra.sweep.subdir="$1"
}
sweep_parallel() {  # all of SWEEP_PRECISIONS at once; each logs to sweep_<p>.log
  local p pids=()
  for p in $SWEEP_PRECISIONS; do
    sweep_run "$p" > "$WORK/sweep_$p.log" 2>&1 &
    pids+=($!)
  done
  trap 'kill "${pids[@]}" 2>/dev/null' TERM
  wait "${pids[@]}"
}
export -f sweep_run sweep_parallel
export DEVICE TRAIN_UTTS TRAIN_BATCH TRAIN_EPOCHS TRAIN_WARMUP TRAIN_WORKERS DECODER M_EXTRA WORK \
  SWEEP_PRECISIONS
part_sweep_alone() {  # part_sweep_alone PRECISION (timeout runs programs, not functions)
  run_part "sweep_$1" "$SWEEP_LIMIT" bash -c 'sweep_run "$0"' "$1"
}
part_sweep() {
  if [ "$SWEEP_PARALLEL" = 1 ]; then
    run_part sweep "$SWEEP_LIMIT" bash -c sweep_parallel
  else
    for p in $SWEEP_PRECISIONS; do
      part_sweep_alone "$p"
    done
  fi
}

# the parts are the part_* functions above (sweep_<p>: part_sweep_alone for one precision)
PART_NAMES=$(declare -F | sed -n 's/^declare -f part_//p' | grep -vx sweep_alone | tr '\n' ' ')
for part in $PARTS; do
  case $part in
    sweep_*) part_sweep_alone "${part#sweep_}" ;;
    *)
      if [[ " $PART_NAMES " == *" $part "* ]]; then
        "part_$part"
      else
        echo "$part: unknown part (${PART_NAMES}sweep_<p>)" | tee -a "$WORK/parts.txt"
      fi
      ;;
  esac
done
for sweep_dir in "$WORK/sweep_gpu_asr" "$WORK/default_runs"; do  # a cut sweep: what finished
  [ -d "$sweep_dir" ] && python3 -c "import pathlib, sys
from amp_utils.sweep_summary import summarize_sweep; summarize_sweep(pathlib.Path(sys.argv[1]))" \
    "$sweep_dir" >> "$WORK/summary.log" 2>&1
done

# TensorBoard event files come back too (tens of kB a run: the per-step loss curves that
# tell a model that is learning slowly from one that is not)
tar czf "$OUT/results_$(echo $PARTS | tr ' ' '-' | cut -c1-40).tgz" --exclude=checkpoints \
  --exclude='results_*.tgz' -C "$WORK" . 2>/dev/null
{
  cat "$WORK/parts.txt"
  for md in "$WORK"/bench_graphs/benchmark.md "$WORK"/bench_graphs_unfused/benchmark.md \
    "$WORK"/bench_graphs_brain/benchmark.md "$WORK"/bench_m_depthwise_*/benchmark.md \
    "$WORK"/bench_graphs_low_norms/benchmark.md \
    "$WORK"/bench_graphs_compiled/benchmark.md \
    "$WORK"/bench_m_graphs/benchmark.md "$WORK"/bench_m_norm_saves_*/benchmark.md \
    "$WORK"/bench_m/benchmark.md "$WORK"/activation_memory_norms_*/activation_memory.md \
    "$WORK"/activation_memory_norms_*/activation_memory_compiled.md \
    "$WORK"/activation_memory_norms_*/step_operations.md \
    "$WORK"/default_runs/summary.md "$WORK"/default_runs/epoch_split.md \
    "$WORK"/sweep_gpu_asr/summary.md "$WORK"/bench_small/benchmark.md \
    "$WORK"/bench_small_eager/benchmark.md; do
    fresh "$md" && { echo "== $md"; cat "$md"; }
  done
  for profile in "$WORK"/bench_*graphs*/profile_brain_*.txt \
    "$WORK"/bench_m_depthwise_*/profile_brain_*.txt; do  # kernels, compiled code
    fresh "$profile" && echo "$(basename "$(dirname "$profile")")/$(basename "$profile"):" \
      "$(head -1 "$profile")"
  done
  for log in "$WORK/graph_tests.log" "$WORK/gpu_tests.log"; do
    fresh "$log" && grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$log"
  done
  for log in "$WORK"/bench_graphs.log "$WORK"/bench_graphs_compiled.log \
    "$WORK"/bench_m_graphs.log "$WORK"/default_runs.log; do  # why not captured, if not
    fresh "$log" && grep -E "graph_step|Captured" "$log" | sed -E 's/^\[[^]]*\]//' \
      | sed -E 's/batch shape \[.*\] as CUDA graph [0-9]+/a batch shape/' | sort | uniq -c | sort -rn | head -8
  done
} > "$OUT/summary_$(echo $PARTS | cut -c1-12 | tr ' ' '-').md"
cat "$OUT"/summary_*.md | tail -60
echo "done in $((SECONDS - START)) s"
