#!/usr/bin/env bash
# Validate and measure foscar on a GPU machine, from a checkout (nothing installed): the GPU tests,
# then optionally the tuner, the speed benchmark and the accuracy study. Each step writes under $OUT
# and prints a short summary; a failing step does not stop the later ones.
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh tests            # GPU tests (Triton, API, append, non-finite
#                                                                #   inputs, API fuzz, CLI, HF, SASS; CuTe too
#                                                                #   when the cute step installed it)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh tvm WHEELS       # install apache-tvm-ffi (the CuTe kernels' calls)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh cute BUNDLE_DIR  # install cutlass-dsl, smoke runs, the CuTe GPU tests
#   OUT=/tmp/out bash benchmarks/gpu_session.sh first-call       # first CuTe decode of a process, cold/warm disk cache
#   OUT=/tmp/out bash benchmarks/gpu_session.sh profile [B:L ...]  # Nsight Compute sections of the CuTe v1 decode
#                                                                #   kernel, INT2 and INT4 (after the cute step)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh sanitize [KINDS]  # compute-sanitizer memcheck/racecheck/synccheck
#   OUT=/tmp/out bash benchmarks/gpu_session.sh racecheck-narrow # racecheck's report on E4M3 K, one switch at a time
#   OUT=/tmp/out bash benchmarks/gpu_session.sh b1-long          # B 1 at long contexts: split sweep, ncu (INT4)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh v-bits-numerics  # the FP16 PV chain at V^T's magnitudes; the stress study per V^T switch
#   OUT=/tmp/out bash benchmarks/gpu_session.sh triton-lazy      # the Triton kernel's lazy rescale: GPU tests, then
#                                                                #   timed against the eager one at GQA 4, 16, 32
#   OUT=/tmp/out bash benchmarks/gpu_session.sh wide-eight-speed # three consumers at 8 columns, timed; steps of 2
#   OUT=/tmp/out bash benchmarks/gpu_session.sh step-ring        # the Triton step over a channel-wise K ring at head
#                                                                #   dim 128: plainly, then under memcheck
#   OUT=/tmp/out bash benchmarks/gpu_session.sh cute-bench       # Triton vs CuTe (and auto): paper grid, axes, GQA
#   OUT=/tmp/out bash benchmarks/gpu_session.sh tune [cute]      # foscar tune --preset paper -> foscar/tuning
#   OUT=/tmp/out bash benchmarks/gpu_session.sh speed WHEELS     # install FlashInfer, paper + axes grids
#   OUT=/tmp/out bash benchmarks/gpu_session.sh accuracy [cute]  # the stress study through one GPU backend
#   OUT=/tmp/out bash benchmarks/gpu_session.sh heads WHEELS     # the GQA sweep (paper Fig. 15), FlashInfer baseline
#   OUT=/tmp/out bash benchmarks/gpu_session.sh rows WHEELS      # 16/32 columns, head dim 256, E4M3 term blocks: GPU
#                                                                #   tests, then timings beside FlashInfer BF16
#   OUT=/tmp/out bash benchmarks/gpu_session.sh lazy WHEELS      # the lazy rescale in one-tile passes: GPU tests with
#                                                                #   the flag set, then GQA 8-32 and steps timed with and
#                                                                #   without it, FlashInfer BF16 beside
#   OUT=/tmp/out bash benchmarks/gpu_session.sh terms WHEELS     # Q as three E4M3 terms: GPU tests, the stress study
#                                                                #   through two and three terms, their speed
#   OUT=/tmp/out bash benchmarks/gpu_session.sh install-cute BUNDLE_DIR  # install cutlass-dsl only (after tvm)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh pipeline-tests   # v1's stages and prologues, the lazy
#                                                                #   rescale in one-tile passes, three Q terms: GPU tests
#   OUT=/tmp/out bash benchmarks/gpu_session.sh pending [NAME]   # the GPU tests of switches not yet run on a GPU
#                                                                #   ($JOBS pytest processes a set, default 6)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh pending-speed [NAME]  # those switches against the shipped kernels
#   OUT=/tmp/out bash benchmarks/gpu_session.sh overlap-speed    # overlapped passes against the shipped kernels
#   OUT=/tmp/out bash benchmarks/gpu_session.sh priority         # the GPU tests of the likeliest gains' switches
#   OUT=/tmp/out bash benchmarks/gpu_session.sh steps-switches V  # steps of 8 tokens: shipped, each variant, shipped
#   OUT=/tmp/out bash benchmarks/gpu_session.sh steps-windows    # after install-cute: steps over a channel-wise-K ring
#                                                                #   (KIVI-style): the CuTe columns (auto), the causal
#                                                                #   view's rows (WINDOWED_STEPS=0), then Triton
#   OUT=/tmp/out bash benchmarks/gpu_session.sh switches WHEELS [VARIANT ...]  # kernel switches (run_with.py
#                                                                #   words) against the shipped ones, paper grid;
#                                                                #   the fastest written to /tmp/foscar-variant
#   OUT=/tmp/out bash benchmarks/gpu_session.sh retune           # foscar tune --backend cute (stages among the
#                                                                #   candidates), then the paper grid beside FlashInfer,
#                                                                #   both with /tmp/foscar-variant's switches
#   OUT=/tmp/out bash benchmarks/gpu_session.sh cluster-merge    # the split merge in a cluster: one decode a process
#                                                                #   under a timeout, then its GPU tests if none hung
#   OUT=/tmp/out bash benchmarks/gpu_session.sh fi-parts DIR     # FlashInfer from its wheel cut in parts (DIR/fi-part-*)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh ab BASE [ARGS ...]  # foscar.decode from another commit's foscar
#                                                                #   (folder BASE) and this one, side by side (ab-axes
#                                                                #   BASE [SHAPES] [BITS]: the axes grid)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh grid [PART]      # paper and axes grids, GQA sweep, steps: foscar.decode
#                                                                #   beside FlashInfer BF16 (after install-cute, fi-parts)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh tune-more [PART] # foscar tune (CuTe) into $TUNE_DIR (default /tmp/tun):
#                                                                #   INT4's paper shapes, GQA 16 and 32, steps of 2-8
#                                                                #   tokens, the channel-wise axes (after install-cute);
#                                                                #   then `TUNE_DIR=/tmp/tun ... grid` times with them
#   OUT=/tmp/out bash benchmarks/gpu_session.sh triton-gqa       # the Triton kernel tuned at GQA 16 and 32, then
#                                                                #   beside FlashInfer BF16 (after fi-parts)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh fa4 WHEELS       # FlashAttention-4 (cutlass-dsl installed first by
#                                                                #   the cute step on the same warm machine)
#
# Each step also packs its outputs into $OUT/<step>.tgz: a reply brings back a limited number of files.
#
# The install steps take the offline bundles described in ../shared/device/README.md (cutlass-dsl) and
# benchmarks/bench_decode.py's docstring (FlashInfer wheels). The apache-tvm-ffi wheel (CPython 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .gpu-tvm apache-tvm-ffi==0.1.15.post2
# The cutlass-dsl bundle and the wheel do not fit one device call together (64 MiB): run `tvm` with
# carry [".gpu-tvm"], then `cute` with carry [".gpu"], on the same warm machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/foscar-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step="${1:?usage: gpu_session.sh tests|tvm WHEELS|cute BUNDLE|sanitize [KINDS]|cute-bench|tune|speed WHEELS|accuracy|heads WHEELS|rows WHEELS|lazy WHEELS|terms WHEELS|fa4 WHEELS}"
parallel_pytest() {  # parallel_pytest NAME RUNNER SELECTION: SELECTION's GPU tests over $JOBS processes of RUNNER
  local name=$1 runner=$2 sel=$3 jobs=${JOBS:-6} f
  eval "$runner --collect-only -q -m gpu $sel" 2> /dev/null | grep "::" > "$OUT/ids-$name"  # eval: a quoted -k
  split -n "l/$jobs" -d "$OUT/ids-$name" "$OUT/ids-$name-"  # contiguous: a kernel's cases mostly in one process
  for f in "$OUT/ids-$name"-*; do
    [ -s "$f" ] || continue
    (mapfile -t ids < "$f"; timeout 420 $runner -q -s -m gpu -p no:cacheprovider "${ids[@]}" < /dev/null > "$f.log" 2>&1
     echo "rc=$?" >> "$f.log") &
  done
  wait
  cat "$OUT/ids-$name"-*.log > "$OUT/pending-$name.log" 2> /dev/null
  rm -f "$OUT/ids-$name" "$OUT/ids-$name"-*
  echo "$name: $(grep -cE "^rc=0" "$OUT/pending-$name.log") of $jobs processes rc=0;" \
    "$(grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$OUT/pending-$name.log" | tr '\n' ' ')"
}

case "$step" in
  tests)  # one pytest per file, each with its summary line (a timeout loses at most the file it was in)
    for f in tests/test_triton.py tests/test_api.py tests/test_append.py tests/test_nonfinite.py tests/test_fuzz_api.py \
             tests/test_cli.py tests/test_transformers.py tests/test_sass.py tests/test_rotation.py tests/test_centring.py; do
      python3 -m pytest -q "$f" > "$OUT/tests-$(basename "$f" .py).log" 2>&1
      echo "$f: $(tail -1 "$OUT/tests-$(basename "$f" .py).log")"
    done ;;
  tvm)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?tvm needs the apache-tvm-ffi wheel folder}"/*.whl
    python3 -c "import tvm_ffi; print('apache-tvm-ffi', tvm_ffi.__version__)" ;;
  cute)  # install cutlass-dsl; a bounded smoke run of v0 and v1 (a pipeline hang costs 90 s, not the command);
          # then the GPU tests of v0, and of v1 when its smoke run came back; the API tests; host time per call
    bundle="${2:?cute needs the cutlass-dsl bundle folder (install-cute-dsl.sh beside it)}"
    python3 -c "import tvm_ffi" 2>/dev/null || { echo "apache-tvm-ffi is missing: run the tvm step first"; exit 1; }
    bash "$(dirname "$bundle")/install-cute-dsl.sh" "$bundle" > "$OUT/cute-install.log" 2>&1
    echo "install rc=$? $(tail -1 "$OUT/cute-install.log")"
    # byte-compile it as pip would (the bundle is unpacked; this machine sets PYTHONDONTWRITEBYTECODE): else
    # every process compiles cutlass-dsl's sources again, seconds of each first CuTe call
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m compileall -q -j 8 "$site/nvidia_cutlass_dsl" "$site/tvm_ffi" > /dev/null 2>&1
    sel="v0"
    for kind in cute cute_ws; do
      timeout 90 python3 benchmarks/sanitize_one.py $kind > "$OUT/smoke-$kind.log" 2>&1; rc=$?
      echo "smoke $kind rc=$rc $(tail -1 "$OUT/smoke-$kind.log")"
      [ "$kind" = cute_ws ] && [ $rc = 0 ] && sel="v0 or v1"
    done
    timeout 300 python3 -m pytest -q -s -m gpu -k "$sel or auto" tests/test_cute_decode.py tests/test_cute_variants.py > "$OUT/cute.log" 2>&1
    grep -E "error|passed|failed" "$OUT/cute.log" | tail -14
    timeout 250 python3 -m pytest -q tests/test_api.py tests/test_cli.py tests/test_transformers.py > "$OUT/cute-api.log" 2>&1  # auto is CuTe
    echo "tests/test_api.py tests/test_cli.py tests/test_transformers.py (auto = cute): $(tail -1 "$OUT/cute-api.log")"
    timeout 200 python3 -m pytest -q -s tests/test_cute_combine.py tests/test_cute_compile_cache.py tests/test_cute_e4m3.py \
      tests/test_splitkv.py tests/test_rotation.py tests/test_centring.py > "$OUT/cute-more.log" 2>&1
    echo "combine, compile cache, E4M3 probe, split-KV, rotation: $(tail -1 "$OUT/cute-more.log")"
    timeout 90 python3 benchmarks/host_overhead.py --shape 1:8K --bits 4 --profile > "$OUT/host-overhead.log" 2>&1
    head -12 "$OUT/host-overhead.log" ;;
  first-call)  # the first CuTe decode of a fresh process, cold and warm disk compile cache (after the cute step)
    python3 benchmarks/first_call.py --shapes 1:8192 8:32768 > "$OUT/first-call.md" 2>&1; cat "$OUT/first-call.md" ;;
  profile)  # ncu (clocks left alone) on the second v1 stage-1 kernel of a process (ws_kernel: the combine is a CuTe
            # kernel too): throughput, stall reasons per issued instruction, issue slots, instruction mix and the
            # top stall sites, the SMs' least, mean and most active cycles (a wave's imbalance), per B:L (default
            # 64:131072) and bits; PROFILE_ARGS: more name=value arguments of profile_one_call.py (kv_heads=1,
            # q_len=8), PROFILE_TAG a suffix of the records' names, PROFILE_SWITCHES run_with.py's words, PROFILE_BITS
    run=(python3); [ -n "${PROFILE_SWITCHES:-}" ] && run=(python3 benchmarks/run_with.py $PROFILE_SWITCHES --)
    for shape in ${2:-64:131072}; do for bits in ${PROFILE_BITS:-2 4}; do
      ncu --clock-control none -k regex:ws_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section Occupancy --section SourceCounters \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg" \
        "${run[@]}" benchmarks/profile_one_call.py ${shape%%:*} ${shape##*:} $bits backend=cute ${PROFILE_ARGS:-} \
        > "$OUT/profile-${shape/:/-}-int$bits${PROFILE_TAG:-}.txt" 2>&1
      echo "profile $shape INT$bits rc=$? $(grep -E "^ +Duration" "$OUT/profile-${shape/:/-}-int$bits${PROFILE_TAG:-}.txt" | head -1)"
    done; done ;;
  sanitize)  # compute-sanitizer on one small decode per kernel (cutlass-dsl installed by the cute step);
             # SANITIZE_SWITCHES: kernel switches (run_with.py words) set for every kind, SANITIZE_TAG their logs' tag
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for kind in ${2:-triton cute cute_ws cute_pair}; do for tool in memcheck racecheck synccheck; do
      log="$OUT/sanitize-$kind${SANITIZE_TAG:-}-$tool.log"
      timeout 150 "$CS" --tool $tool --report-api-errors no --error-exitcode 1 python3 benchmarks/run_with.py \
        ${SANITIZE_SWITCHES:-} -- benchmarks/sanitize_one.py $kind > "$log" 2>&1; echo "$kind $tool rc=$? $(tail -1 "$log")"
    done; done ;;
  racecheck-narrow)  # racecheck on the E4M3 K kernel (benchmarks/racecheck_probe.py): as it ships (three runs), with one
                     # barrier after sum(Q)'s stores (two runs), the sums by the producer's third warp; then cute_ws2
                     # (BF16 K) beside (RACE_VARIANTS: other variants of racecheck_probe.py, or switches)
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for v in ${RACE_VARIANTS:-shipped shipped shipped bars=1 bars=1 sumwarps=2}; do
      case $v in [A-Z]*) run="benchmarks/run_with.py $v -- benchmarks/racecheck_probe.py shipped" ;;
                 *) run="benchmarks/racecheck_probe.py $v" ;; esac
      log="$OUT/race-${v//[=:,]/_}.log"
      timeout 150 "$CS" --tool racecheck --racecheck-report hazard --report-api-errors no --error-exitcode 1 \
        python3 $run > "$log" 2>&1
      echo "$v rc=$? $(tail -1 "$log") blocks: $(grep -o "block ([0-9,]*)" "$log" | sort | uniq -c | tr -s ' \n' ' ')"
    done
    timeout 150 "$CS" --tool racecheck --report-api-errors no --error-exitcode 1 python3 benchmarks/sanitize_one.py \
      cute_ws2 > "$OUT/race-cute_ws2.log" 2>&1; echo "cute_ws2 rc=$? $(tail -1 "$OUT/race-cute_ws2.log")" ;;
  v-bits-numerics)  # after install-cute: the tensor core's FP16 PV chain at V^T's operand magnitudes, and with P'
                     # carrying 2^(4 - shl) (f16_magnitude_probe.py), then the stress study: as shipped, V^T from bit 0 and by row class
                     # with P' as from bit 4 up (V_PRODUCT_BIT=0: as first measured) and with every product in bit
                     # 4's units (the default V_PRODUCT_BIT), from bit 0 alone, the words off one base alone
    timeout 120 python3 benchmarks/f16_magnitude_probe.py > "$OUT/f16-magnitude.md" 2>&1
    echo "probe rc=$?"; cat "$OUT/f16-magnitude.md"
    for v in V_LOW_PLACEMENT=0 "V_LOW_PLACEMENT=1 V_ROW_SHIFTS=1 V_PRODUCT_BIT=0" "V_LOW_PLACEMENT=1 V_ROW_SHIFTS=1" \
             V_LOW_PLACEMENT=1 FLAT_WORDS=1; do
      name="accuracy-${v//[ =]/_}"
      timeout 150 python3 benchmarks/run_with.py $v -- foscar.bench.cli accuracy --backend cute --lengths 4096 16384 \
        --out "$OUT/$name" > "$OUT/$name.log" 2>&1
      echo "$v rc=$?"; grep -E "^\| INT[24] (min-max|mse-clipped) \|" "$OUT/$name.log" | cut -d'|' -f2,3,7
    done ;;
  steps-crash)  # after install-cute: bench_steps.py with the H200's tuned steps entries
                # (docs/bench/h200/tune-steps-held-1206.json, named for this GPU) in FOSCAR_TUNING_DIR, to find where a
                # replay fails (docs/bench/h100/steps-crash-bisect-1206.md: the benchmark's freed queries, since mended).
                # steps-crash [PART ...]: locate (the failing command with --sync-each: each call's plan, and the
                # replay the error follows), halves (each bits' half of the held entries), seeds (64:128K INT2 alone
                # at six query seeds: the one input the earlier shapes' history changes), memcheck (the failing
                # command under compute-sanitizer); default locate seeds
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    shift; parts="${*:-locate seeds}"
    python3 - <<'PY'
import json, os, torch
from foscar.autotune import normalize_gpu_name
gpu = normalize_gpu_name(torch.cuda.get_device_name())  # another Hopper GPU takes the H200's entries as its own
t = json.load(open("docs/bench/h200/tune-steps-held-1206.json"))
t["meta"]["gpu"] = gpu
for e in t["entries"]:
    e["key"]["gpu"] = gpu
for name, keep in (("all", lambda k: True), ("int2", lambda k: k["bits"] == 2), ("int4", lambda k: k["bits"] == 4)):
    os.makedirs(f"/tmp/held-{name}", exist_ok=True)
    json.dump(dict(t, entries=[e for e in t["entries"] if keep(e["key"])]), open(f"/tmp/held-{name}/{gpu}.json", "w"))
PY
    case " $parts " in *" locate "*)
      FOSCAR_TUNING_DIR=/tmp/held-all timeout 200 python3 benchmarks/bench_steps.py --backends auto --sync-each \
        > "$OUT/steps-held-locate.md" 2>&1
      echo "locate rc=$?"; grep -E "^replay|illegal|INT2 B 64 L 131072" "$OUT/steps-held-locate.md" | head -12 ;; esac
    case " $parts " in *" halves "*) for name in all int2 int4; do
      FOSCAR_TUNING_DIR=/tmp/held-$name timeout 150 python3 benchmarks/bench_steps.py --backends auto \
        > "$OUT/steps-held-$name.md" 2>&1
      echo "held $name rc=$? $(grep -c '^| [0-9]' "$OUT/steps-held-$name.md") rows $(grep -m1 -o 'an illegal [a-z ]*' "$OUT/steps-held-$name.md")"
    done ;; esac
    case " $parts " in *" seeds "*) for seed in 0 1 2 3 4 5; do
      FOSCAR_TUNING_DIR=/tmp/held-all timeout 60 python3 benchmarks/bench_steps.py --backends auto --shapes 64:128K \
        --bits 2 --seed $seed > "$OUT/steps-held-seed-$seed.md" 2>&1
      echo "seed $seed rc=$? $(grep -m1 -o 'an illegal [a-z ]*' "$OUT/steps-held-seed-$seed.md")"
    done ;; esac
    case " $parts " in *" memcheck "*)
      FOSCAR_TUNING_DIR=/tmp/held-all timeout 560 compute-sanitizer --tool memcheck --print-limit 20 python3 \
        benchmarks/bench_steps.py --backends auto --iters 2 > "$OUT/steps-held-memcheck.log" 2>&1
      echo "memcheck rc=$?"; grep -E "Invalid|Illegal|illegal|at 0x|by thread|ERROR SUMMARY" "$OUT/steps-held-memcheck.log" | head -20 ;; esac ;;
  b1-long)  # after install-cute: why B 1 at long contexts reads 62-75% of the ceiling where B 8 and 64 read 88-98%
            # (INT4, the same CTA count): the split sweep at B 1, L 128K and 512K beside B 8, L 128K (one and two
            # CTAs an SM), then Nsight Compute's memory, warp-state and occupancy sections of the tuned call
    timeout 300 python3 benchmarks/sweep_cute.py --shapes 1:128K 1:512K 8:128K --bits 4 --variants tuned v1 v1x2 \
      --splits 0.5 1 2 > "$OUT/b1-long-sweep.md" 2>&1; echo "sweep rc=$?"; tail -8 "$OUT/b1-long-sweep.md"
    for shape in "1 524288" "8 131072"; do
      timeout 120 ncu --clock-control none -k regex:v1FoldDecode --launch-skip 1 --launch-count 1 --section \
        SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy python3 \
        benchmarks/profile_one_call.py $shape 4 backend=cute > "$OUT/ncu-b1-long-${shape// /-}.txt" 2>&1
      echo "ncu $shape rc=$?"; grep -E "Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy" \
        "$OUT/ncu-b1-long-${shape// /-}.txt"
    done ;;
  triton-lazy)  # Triton alone (the tvm call will do): the lazy rescale's GPU tests, then the kernel with and without
                # it at GQA 4, 16 and 32 (B 8, L 128K, Hq 32; the heuristic's splits and twice as many)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_lazy.py > "$OUT/triton-lazy-tests.log" 2>&1
    echo "triton-lazy tests rc=$? $(tail -1 "$OUT/triton-lazy-tests.log")"
    for h in 8 2 1; do
      timeout 150 python3 benchmarks/sweep_triton.py --shapes 8:128K --kv-heads $h --splits 1 2 --warps 4 \
        --stages 1 --lazy 0 1 > "$OUT/triton-lazy-kv$h.log" 2>&1
      echo "triton-lazy Hkv $h rc=$?"; grep -E "^B=|BEST" "$OUT/triton-lazy-kv$h.log" | tail -10
    done ;;
  step-ring)  # Triton alone (the tvm call will do): its step over a channel-wise K ring at head dim 128 (B 2, L 1K,
              # 4 tokens), plainly with CUDA_LAUNCH_BLOCKING, then under compute-sanitizer memcheck
    CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 benchmarks/sanitize_one.py triton_step_ring > "$OUT/step-ring.log" 2>&1
    echo "step-ring rc=$?"; tail -12 "$OUT/step-ring.log"
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    timeout 240 "$CS" --tool memcheck --report-api-errors no --error-exitcode 1 python3 benchmarks/sanitize_one.py \
      triton_step_ring > "$OUT/sanitize-triton_step_ring-memcheck.log" 2>&1
    echo "memcheck rc=$?"
    grep -m 12 -E "Invalid|at 0x|by thread|Address|ERROR SUMMARY" "$OUT/sanitize-triton_step_ring-memcheck.log" ;;
  cute-bench)  # Triton against CuTe v0, v1 (and v1 with E4M3 K operands) and foscar.decode's own pick: paper grid; v0 and v1 on the four
               # axis combinations and GQA 1, 2 and 8 (the paper grid is GQA 4); cutlass-dsl installed and
               # the host time per call measured by the cute step
    python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_folded foscar_cute foscar_cute_ws \
      foscar_cute_e4m3 foscar_auto --out "$OUT/cute-bench" > "$OUT/cute-bench.log" 2>&1; grep "done in" "$OUT/cute-bench.log"
    python3 -m foscar.bench.decode --grid axes --cuda-graph --kernels foscar_folded foscar_cute foscar_cute_ws \
      --out "$OUT/cute-axes" > "$OUT/cute-axes.log" 2>&1; grep "done in" "$OUT/cute-axes.log"
    for h in 32:32 32:16 32:4; do
      python3 -m foscar.bench.decode --shapes 1:128K,8:8K,8:128K,64:32K --heads $h --cuda-graph \
        --kernels foscar_folded foscar_cute foscar_cute_ws --out "$OUT/cute-heads/${h/:/-}" > "$OUT/cute-heads-${h/:/-}.log" 2>&1
      echo "heads $h"; grep "done in" "$OUT/cute-heads-${h/:/-}.log"
    done ;;
  tune)  # tune [BACKEND]: triton (default) or cute (cutlass-dsl installed by the cute step)
    python3 -m foscar.tune --backend "${2:-triton}" --preset paper --bits 2 4 --out foscar/tuning \
      > "$OUT/tune-${2:-triton}.md" 2> "$OUT/tune-${2:-triton}.log"
    tail -30 "$OUT/tune-${2:-triton}.md"; cp foscar/tuning/*.json "$OUT/" 2>/dev/null ;;
  speed)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?speed needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    python3 -m foscar.bench.decode --grid paper --cuda-graph --out "$OUT/paper" --kernels foscar_folded \
      foscar_reconstruct flashinfer_tc cudnn_sdpa flashinfer_fp8 flashinfer_nvfp4 foscar_cute > "$OUT/paper.log" 2>&1
    python3 -m foscar.bench.decode --grid axes --cuda-graph --kernels foscar_folded flashinfer_tc --out "$OUT/axes" \
      > "$OUT/axes.log" 2>&1
    grep -A8 "^| bar" "$OUT/paper.log"; grep "^Geomean" "$OUT/paper.log"
    python3 -m foscar.bench.cli plot "$OUT/paper/bench_decode.json" "$OUT/axes/bench_decode.json" --out "$OUT" ;;
  accuracy)  # accuracy [BACKEND]: triton (default) or cute (cutlass-dsl installed by the cute step)
    b="${2:-triton}"
    python3 -m foscar.bench.cli accuracy --backend "$b" --out "$OUT/accuracy-$b" > "$OUT/accuracy-$b.log" 2>&1
    tail -14 "$OUT/accuracy-$b.log" ;;
  heads)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?heads needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    for h in 32:1 32:2 32:4 32:8 32:16 32:32; do  # the first run JIT-compiles FlashInfer's module per head ratio
      python3 -m foscar.bench.decode --shapes 8:128K --heads $h --cuda-graph --kernels foscar_folded flashinfer_tc \
        --out "$OUT/heads/${h/:/-}" > "$OUT/heads-${h/:/-}.log" 2>&1; echo "$h rc=$?"
    done
    python3 -m foscar.bench.cli plot "$OUT"/heads/*/bench_decode.json --out "$OUT/heads" --name heads ;;
  lazy)  # after the cute step: foscar.cute.config.LAZY_ONE_TILE's GPU tests (a fixture sets it), then its timings
    python3 -m pytest -q -s -m gpu tests/test_cute_variants.py -k "lazy_one_tile" > "$OUT/lazy-one-tile-tests.log" 2>&1
    echo "lazy one-tile tests: $(tail -1 "$OUT/lazy-one-tile-tests.log")"
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?lazy needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    python3 benchmarks/sweep_rows.py --shapes 8:128K --heads 32:4 32:2 32:1 --bits 2 4 --splits 1 --ctas 1 2 \
      --k-operands bf16 e4m3 --lazy-one-tile off on --flashinfer > "$OUT/lazy-one-tile-heads.md" 2>&1; echo "heads rc=$?"
    python3 benchmarks/sweep_rows.py --shapes 8:128K,64:32K --heads 32:8 --q-len 2 4 8 --bits 2 4 --splits 1 \
      --ctas 2 --k-operands e4m3 --lazy-one-tile off on > "$OUT/lazy-one-tile-steps.md" 2>&1; echo "steps rc=$?" ;;
  terms)  # after the cute step: k_operand e4m3x3 (three Q terms) against the oracle, the stress study through the
           # two- and three-term variants, then their speed on the paper grid beside foscar.decode and FlashInfer
    python3 -m pytest -q -s -m gpu tests/test_cute_variants.py -k "three_q_terms" > "$OUT/terms-tests.log" 2>&1
    echo "three-term tests: $(tail -1 "$OUT/terms-tests.log")"
    for k in e4m3 e4m3x3; do
      python3 -m foscar.bench.cli accuracy --backend cute --k-operand $k --out "$OUT/accuracy-cute-$k" \
        > "$OUT/accuracy-cute-$k.log" 2>&1; echo "accuracy $k rc=$?"
    done
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?terms needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_cute_e4m3 foscar_cute_e4m3x3 foscar_auto \
      flashinfer_tc --out "$OUT/terms-paper" > "$OUT/terms-paper.log" 2>&1; echo "terms paper rc=$?" ;;
  digits)  # after install-cute: k_operand e4m3d4 (Q as four integer digits) against the oracle, then the stress study
            # through it and through BF16 K (the bar's reference), each length and seed
    python3 -m pytest -q -s -m gpu tests/test_cute_variants.py -k "four_q_digits" > "$OUT/digits-tests.log" 2>&1
    echo "four-digit tests: $(tail -1 "$OUT/digits-tests.log")"
    for k in e4m3d4 bf16; do
      timeout 200 python3 -m foscar.bench.cli accuracy --backend cute --k-operand $k --lengths 1024 4096 16384 \
        --out "$OUT/accuracy-cute-$k" > "$OUT/accuracy-cute-$k.log" 2>&1; echo "accuracy $k rc=$?"
      grep "INT2 min-max |" "$OUT/accuracy-cute-$k/accuracy.md" | head -3
    done ;;
  rows)  # after the cute step: the GPU tests of 16/32 columns, head dim 256 and E4M3 term blocks; then timings
          # with FlashInfer BF16 beside (its wheels folder as $2): head dim 256, and E4M3 against BF16 K beyond 4 rows
    python3 -m pytest -q -s -m gpu tests/test_cute_decode.py tests/test_cute_variants.py tests/test_multitoken.py \
      -k "sixteen or head_dim_256 or term_blocks or columns_gpu" > "$OUT/rows-tests.log" 2>&1
    echo "rows tests: $(tail -1 "$OUT/rows-tests.log")"
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?rows needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    python3 benchmarks/sweep_rows.py --shapes 8:32K,64:32K,8:128K,64:128K --heads 16:8 8:4 --head-dim 256 --bits 4 \
      --splits 1 --ctas 1 --flashinfer > "$OUT/rows-d256.md" 2>&1; echo "d256 rc=$?"
    python3 benchmarks/sweep_rows.py --shapes 8:128K --heads 32:4 32:2 --bits 2 4 --splits 1 --ctas 1 2 \
      --k-operands bf16 e4m3 > "$OUT/rows-e4m3.md" 2>&1; echo "e4m3 heads rc=$?"
    python3 benchmarks/sweep_rows.py --shapes 8:128K,64:32K --heads 32:8 --q-len 2 4 --bits 2 4 --splits 1 \
      --ctas 1 2 --k-operands bf16 e4m3 > "$OUT/rows-e4m3-steps.md" 2>&1; echo "e4m3 steps rc=$?" ;;
  install-cute)  # cutlass-dsl alone (byte-compiled, as the cute step does), no tests
    bundle="${2:?install-cute needs the cutlass-dsl bundle folder (install-cute-dsl.sh beside it)}"
    bash "$(dirname "$bundle")/install-cute-dsl.sh" "$bundle" > "$OUT/cute-install.log" 2>&1
    echo "install rc=$? $(tail -1 "$OUT/cute-install.log")"
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m compileall -q -j 8 "$site/nvidia_cutlass_dsl" "$site/tvm_ffi" > /dev/null 2>&1 ;;
  pipeline-tests)  # pipeline-tests [PYTEST -k]: the default takes the lazy rescale, three Q terms and PDL too
    timeout 540 python3 -m pytest -q -m gpu tests/test_cute_pipeline.py tests/test_cute_pdl.py tests/test_cute_decode.py tests/test_cute_variants.py \
      -k "${2:-pipeline or pdl or lazy_one_tile or three_q_terms}" > "$OUT/pipeline-tests.log" 2>&1
    grep -E "^FAILED|^ERROR|passed|failed" "$OUT/pipeline-tests.log" | tail -12 ;;
  pending)  # after install-cute: the GPU tests of the switches built and not yet run on a GPU (pending [FILTER]:
            # a grep of the names below): Q's stacked terms and shared scale, P^T column-major, channel-wise K on
            # E4M3 terms (one and two tiles a pass, either fold), channel-wise V on two tiles a pass, the TMA
            # prefetches as a CTA starts, steps over BF16 windows and steps in parts (WINDOWED_STEPS; the Triton
            # kernels' steps over windows too), token-wise V's P' in FP16 pairs (pair-p) and the lazy rescale's
            # vote on them (pair-vote), token-wise V^T from bit 0 (v-low), channel-wise K's E4M3 terms past 4 rows
            # (channel-k-rows); channel-wise K's Q' folded by the producer (producer-fold), its E4M3 terms split in
            # FP32 (fold-f32; the shipped FP16 pairs: channel-k, channel-v); channel-wise V^T by placement
            # (channel-v-placement; the shipped channel-wise V: channel-v-shipped), its column sums by the tensor
            # core (column-sum-mma); every GPU test of the
            # tree (every-gpu-test). Each set's tests split over $JOBS
            # (default 6) pytest processes at once: their kernels compile in parallel
    while IFS='|' read -r name runner sel; do
      case "$name" in *${2:-}*) ;; *) continue ;; esac
      parallel_pytest "$name" "$runner" "$sel"
    done <<'TESTS'
channel-k|python3 -m pytest|tests/test_cute_channel_e4m3.py
channel-k-rows|python3 -m pytest|tests/test_cute_channel_e4m3.py -k 'against_the_oracle'
producer-fold|python3 -m pytest|tests/test_cute_channel_e4m3.py tests/test_cute_pipeline.py tests/test_cute_channel_v_pair.py -k producer
producer-unrolled|python3 benchmarks/run_with.py FOLD_UNROLLED_BITS=2 -- pytest|tests/test_cute_channel_e4m3.py tests/test_cute_channel_v_pair.py -k 'producer and gpu'
fold-f32|python3 benchmarks/run_with.py FOLD_F16_SPLIT=0 -- pytest|tests/test_cute_channel_e4m3.py tests/test_cute_channel_v_pair.py
channel-v|python3 -m pytest|tests/test_cute_channel_v_pair.py
channel-v-placement|python3 -m pytest|tests/test_cute_channel_v_placement.py
column-sum-mma|python3 -m pytest|tests/test_cute_column_sum_mma.py tests/test_cute_channel_v_placement.py -k 'column or warps'
channel-v-shipped|python3 -m pytest|tests/test_cute_decode.py tests/test_cute_variants.py tests/test_cute_pipeline.py -k 'channel'
stacked|python3 -m pytest|tests/test_cute_variants.py -k stacked_terms_against
mask-branch|python3 -m pytest|tests/test_cute_mask_branch.py
mask-branch-stacked|python3 benchmarks/run_with.py STACKED_TERMS=1 SHARED_Q_SCALE=1 -- pytest|tests/test_cute_mask_branch.py
pivot-mma|python3 -m pytest|tests/test_cute_pivot_mma.py
stacked-wide|python3 benchmarks/run_with.py STACKED_TERMS=1 SHARED_Q_SCALE=1 P_COLUMN_MAJOR_COLS=8,16,32 -- pytest|tests/test_cute_decode.py -k three_consumers_against
stacked-steps|python3 benchmarks/run_with.py STACKED_TERMS=1 SHARED_Q_SCALE=1 -- pytest|tests/test_multitoken.py -k cute_kernel_takes_a_step
p-layout|python3 -m pytest|tests/test_cute_p_layout.py
channel-pcm|python3 benchmarks/run_with.py P_COLUMN_MAJOR_COLS=8,16,32 -- pytest|tests/test_cute_channel_e4m3.py tests/test_cute_channel_v_pair.py
start-prefetch|python3 -m pytest|tests/test_cute_start_prefetch.py
windowed-steps|python3 -m pytest|tests/test_steps_windows.py tests/test_multitoken.py
pair-p|python3 benchmarks/run_with.py PAIR_P_SCALE_COLS=16,32 -- pytest|tests/test_cute_decode.py tests/test_multitoken.py tests/test_cute_wgmma.py tests/test_cute_fp4.py tests/test_cute_variants.py tests/test_cute_mask_branch.py tests/test_steps_windows.py -k 'sixteen_and_thirtytwo or three_consumers or one_copy or takes_a_step_as_its_columns or steps_of_32 or fp4 or stacked_terms or term_blocks or heads_with or steps_with or cute_kernel'
pair-vote|python3 benchmarks/run_with.py PAIR_P_SCALE_COLS=16,32 PAIR_VOTE=1 -- pytest|tests/test_cute_decode.py tests/test_multitoken.py tests/test_cute_wgmma.py tests/test_cute_fp4.py tests/test_cute_variants.py tests/test_cute_mask_branch.py tests/test_steps_windows.py -k 'sixteen_and_thirtytwo or three_consumers or one_copy or takes_a_step_as_its_columns or steps_of_32 or fp4 or stacked_terms or term_blocks or heads_with or steps_with or cute_kernel'
v-low|python3 benchmarks/run_with.py V_LOW_PLACEMENT=1 -- pytest|tests/test_cute_decode.py tests/test_multitoken.py tests/test_cute_wgmma.py tests/test_cute_variants.py tests/test_cute_mask_branch.py tests/test_steps_windows.py tests/test_cute_pipeline.py tests/test_cute_v_bits.py -k 'sixteen_and_thirtytwo or three_consumers or takes_a_step_as_its_columns or steps_of_32 or stacked_terms or term_blocks or heads_with or steps_with or cute_kernel or oracle or magnitude or placed_v or v_bits'
wide-eight|python3 -m pytest|tests/test_cute_wide_eight.py
cluster-merge|python3 -m pytest|tests/test_cute_cluster_merge.py
one-cta-prologue|python3 benchmarks/run_with.py PROLOGUE_ONE_CTA=4:consumer_q -- pytest|tests/test_cute_decode.py tests/test_cute_variants.py tests/test_cute_pipeline.py
overlap|python3 -m pytest|tests/test_cute_overlap.py
v-bits|python3 -m pytest|tests/test_cute_v_bits.py
fused-merge|python3 -m pytest|tests/test_cute_fused_merge.py
every-gpu-test|python3 -m pytest|tests
TESTS
    ;;
  pending-speed)  # after install-cute and the pending tests (pending-speed [NAME]): the switches against the shipped
                  # kernels, each sweep one process (sweep_switches.py): GQA 32 and 16 with the stacked terms, the
                  # channel-wise combinations, P^T column-major on the ratio and read-share shapes
    filter="${2:-}"  # the loop's set -- takes the positional parameters
    while read -r name args; do
      case "$name" in *$filter*) ;; *) continue ;; esac
      eval "set -- $args"; pre=()  # the options before --variants; then each variant's kernels compiled at once
      while [ $# -gt 0 ] && [ "$1" != "--variants" ]; do pre+=("$1"); shift; done
      [ $# -gt 0 ] && shift
      for v in "$@"; do
        (timeout 200 python3 benchmarks/sweep_switches.py "${pre[@]}" --warm --variants "$v" < /dev/null > /dev/null 2>&1) &
      done
      wait
      eval "timeout 290 python3 benchmarks/sweep_switches.py $args" < /dev/null > "$OUT/sweep-$name.md" 2>&1
      echo "$name rc=$?"; tail -3 "$OUT/sweep-$name.md"
    done <<'SWEEPS'
stacked-gqa32 --shapes 8:128K --heads 32:1 --variants shipped "STACKED_TERMS=1 SHARED_Q_SCALE=1" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1 P_COLUMN_MAJOR_COLS=8,16,32" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1 P_COLUMN_MAJOR_COLS=8,16,32 PIVOT_MMA_COLS=32"
stacked-gqa16 --shapes 8:128K --heads 32:2 --variants shipped "STACKED_TERMS=1 SHARED_Q_SCALE=1" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1 P_COLUMN_MAJOR_COLS=8,16,32" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1 P_COLUMN_MAJOR_COLS=8,16,32 PIVOT_MMA_COLS=16,32 TWO_CTA_COLUMNS=8" "STACKED_TERMS=1 SHARED_Q_SCALE=1 MASK_BRANCH=1 P_COLUMN_MAJOR_COLS=8,16,32 PIVOT_MMA_COLS=16,32 TWO_CTA_COLUMNS=8 WIDE_CONSUMERS=1"
cluster --shapes 1:8K,1:32K,1:128K,8:8K,8:32K,64:8K,64:32K --kernels --variants shipped "CLUSTER_MERGE=1" "PROLOGUE_ONE_CTA=4:consumer_q" "CLUSTER_MERGE=1 PROLOGUE_ONE_CTA=4:consumer_q"
channel --shapes 8:32K,8:128K --axes token:token channel:token token:channel channel:channel --variants shipped "CHANNEL_K_E4M3=1 PAIR_CHANNEL_V=1" "CHANNEL_K_E4M3=1 PAIR_CHANNEL_V=1 PRODUCER_Q_FOLD=1" "CHANNEL_K_E4M3=1 PAIR_CHANNEL_V=1 PRODUCER_Q_FOLD=1 TWO_CTA_COLUMNS=16" "CHANNEL_K_E4M3=1 PAIR_CHANNEL_V=1 P_COLUMN_MAJOR_COLS=8,16,32"
producer-fold-gqa4 --shapes 1:32K,1:128K,8:32K,8:128K --axes channel:token channel:channel --variants shipped PRODUCER_Q_FOLD=1
producer-unrolled --shapes 1:32K,1:128K,8:32K,8:128K --bits 2 --axes channel:token channel:channel --variants shipped PRODUCER_Q_FOLD=1 "PRODUCER_Q_FOLD=1 FOLD_UNROLLED_BITS=2"
producer-fold-gqa8 --shapes 8:32K,8:128K --heads 32:4 --axes channel:token channel:channel --variants shipped PRODUCER_Q_FOLD=1
fold-f16 --shapes 1:32K,1:128K,8:32K,8:128K,64:32K --axes channel:token channel:channel --variants FOLD_F16_SPLIT=0 shipped
v-channel-placement --shapes 1:32K,1:128K,8:32K,8:128K,64:32K --axes token:channel channel:channel --variants shipped V_CHANNEL_PLACEMENT=1
gqa32-v-channel-placement --shapes 8:32K,8:128K --heads 32:1 --axes token:channel --variants shipped V_CHANNEL_PLACEMENT=1
column-sum-mma --shapes 1:32K,1:128K,8:32K,8:128K,64:32K --axes token:channel channel:channel --variants shipped COLUMN_SUM_MMA_COLS=8,16,32
gqa32-column-sum-mma --shapes 8:32K,8:128K --heads 32:1 --axes token:channel --variants shipped COLUMN_SUM_MMA_COLS=8,16,32
gqa16-column-sum-mma --shapes 8:32K,8:128K --heads 32:2 --axes token:channel --variants shipped COLUMN_SUM_MMA_COLS=8,16,32
gqa32-pivot --shapes 8:32K,8:128K --heads 32:1 --variants shipped PIVOT_MMA_COLS=32 WIDE_CONSUMERS=1
gqa16-pivot --shapes 8:32K,8:128K --heads 32:2 --variants shipped "PIVOT_MMA_COLS=16,32 TWO_CTA_COLUMNS=8"
one-cta-prologue --bits 4 --variants shipped "PROLOGUE_ONE_CTA=4:consumer_q"
p-layout --shapes 8:32K,64:128K --variants shipped "P_COLUMN_MAJOR_COLS=8,16,32"
v-bits-gqa32 --shapes 8:128K --heads 32:1 --variants "V_LOW_PLACEMENT=0 V_ROW_SHIFTS=0 FLAT_WORDS=0" shipped
v-bits-paper --shapes 1:8K,1:128K,8:32K,8:128K,64:32K,64:128K --variants "V_LOW_PLACEMENT=0 V_ROW_SHIFTS=0 FLAT_WORDS=0" shipped
flat-words --shapes 8:128K --heads 32:1 --variants shipped FLAT_WORDS=1 "FLAT_WORDS=1 V_LOW_PLACEMENT=1"
flat-words-paper --shapes 1:8K,1:128K,8:32K,8:128K,64:32K,64:128K --variants shipped FLAT_WORDS=1 "FLAT_WORDS=1 V_LOW_PLACEMENT=1"
channel-k-rows --shapes 1:32K,8:32K,8:128K,64:32K --heads 32:4 --axes channel:token channel:channel --variants shipped CHANNEL_K_E4M3_ROWS=8
v-low --shapes 1:8K,8:32K,8:128K,64:32K,64:128K --variants shipped V_LOW_PLACEMENT=1
v-low-gqa32 --shapes 8:128K --heads 32:1 --variants shipped V_LOW_PLACEMENT=1
fused-merge --shapes 1:8K,1:32K,1:128K,8:8K,8:32K,64:8K,64:128K --kernels --variants shipped FUSED_MERGE=1
SWEEPS
    ;;
  overlap-speed)  # after install-cute and `pending overlap`: overlapped passes (OVERLAP_COLS) against the shipped
                  # kernels: GQA 32, 16 and 8 (B 8; 8 and 16 columns at one CTA an SM: TWO_CTA_COLUMNS), then steps
                  # of 2, 4 and 8 tokens at GQA 4 (bench_steps.py, each variant its own process); untuned
                  # (FOSCAR_TUNING=0), so that no tuned entry pins the CTAs an SM a variant changes
    export FOSCAR_TUNING=0
    timeout 200 python3 benchmarks/sweep_switches.py --shapes 8:128K --heads 32:1 --variants shipped "OVERLAP_COLS=32" \
      > "$OUT/sweep-overlap-gqa32.md" 2>&1; echo "gqa32 rc=$?"; tail -3 "$OUT/sweep-overlap-gqa32.md"
    timeout 200 python3 benchmarks/sweep_switches.py --shapes 8:128K --heads 32:2 --variants shipped "TWO_CTA_COLUMNS=8" \
      "OVERLAP_COLS=16,32 TWO_CTA_COLUMNS=8" > "$OUT/sweep-overlap-gqa16.md" 2>&1; echo "gqa16 rc=$?"
    tail -3 "$OUT/sweep-overlap-gqa16.md"
    timeout 200 python3 benchmarks/sweep_switches.py --shapes 8:32K,8:128K --heads 32:4 --variants shipped \
      "TWO_CTA_COLUMNS=" "OVERLAP_COLS=8,16,32 TWO_CTA_COLUMNS=" > "$OUT/sweep-overlap-gqa8.md" 2>&1; echo "gqa8 rc=$?"
    tail -3 "$OUT/sweep-overlap-gqa8.md"
    for v in "" "OVERLAP_COLS=16,32" "OVERLAP_COLS=16,32 TWO_CTA_COLUMNS=8" "OVERLAP_COLS=8,16,32 TWO_CTA_COLUMNS="; do
      timeout 150 python3 benchmarks/run_with.py $v -- benchmarks/bench_steps.py --shapes 8:32K,8:128K,64:32K --bits 2 4 \
        --q-len 1 2 4 8 --backends auto > "$OUT/steps-overlap-${v// /_}.md" 2>&1
      echo "steps ${v:-shipped} rc=$?"; grep "^| [0-9]" "$OUT/steps-overlap-${v// /_}.md" | grep -v "| 1 | " ;
    done ;;
  steps-windows)  # after install-cute: a step over a ring through auto (the CuTe columns), the causal view's rows
                  # (WINDOWED_STEPS=0, backend cute), then the Triton kernel alone (last: it stopped on an illegal
                  # address at head dim 128 on the H200)
    for v in "|auto" "WINDOWED_STEPS=0|cute" "|triton"; do
      timeout 280 python3 benchmarks/run_with.py ${v%|*} -- benchmarks/bench_steps.py --shapes 8:32K,64:32K \
        --bits 2 4 --q-len 1 4 8 --k-axis channel --recent 32 --backends ${v#*|} > "$OUT/steps-windows-${v#*|}.md" 2>&1
      echo "steps-windows $v rc=$?"; tail -14 "$OUT/steps-windows-${v#*|}.md"
    done ;;
  producer-fold)  # after install-cute: channel-wise K with Q' built by the producer (PRODUCER_Q_FOLD), B 8, L 32K
                  # INT2 (benchmarks/producer_fold_probe.py): eager calls, graph replays, replays with the L2 flush,
                  # one process each; then memcheck on the first mode that failed (PF_ARGS: the probe's shape words)
    failed=""
    for mode in eager graph graph_flush; do
      timeout 150 python3 benchmarks/producer_fold_probe.py $mode ${PF_ARGS:-8 32768 2 30} > "$OUT/pf-$mode.log" 2>&1
      rc=$?; echo "producer-fold $mode rc=$rc $(tail -2 "$OUT/pf-$mode.log" | tr '\n' ' ')"
      [ $rc != 0 ] && [ -z "$failed" ] && failed=$mode
    done
    if [ -n "$failed" ]; then
      CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      timeout 300 "$CS" --tool memcheck --report-api-errors no --error-exitcode 1 --print-limit 20 python3 \
        benchmarks/producer_fold_probe.py $failed ${PF_ARGS:-8 32768 2 30} > "$OUT/pf-memcheck.log" 2>&1
      echo "memcheck $failed rc=$?"
      grep -E "^=+ +(Invalid|Error|at |by thread|Address|.*ERROR SUMMARY)" "$OUT/pf-memcheck.log" | head -30
    fi ;;
  bars-own)  # after install-cute, no FlashInfer (one call, about two minutes): the bars foscar's own times decide, the
             # paper grid's read shares at B 8 and 64, B 64 L 128K INT2 against INT4 and B 1 L 8K, and the axes
             # grid's channel-wise combinations against token-wise
    timeout 300 python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_auto --out "$OUT/paper-own" \
      > "$OUT/paper-own.log" 2>&1; echo "paper rc=$?"
    timeout 200 python3 -m foscar.bench.decode --grid axes --cuda-graph --kernels foscar_auto --out "$OUT/axes-own" \
      > "$OUT/axes-own.log" 2>&1; echo "axes rc=$?" ;;
  priority)  # after install-cute, one call: the GPU tests of the pending switches most likely to move the bars (the
             # masks in a branch, alone and with the stacked terms; the pivot sums by the MMA; channel-wise K's two
             # tiles a pass; three consumers at 8 columns). The cluster merge has its own step (cluster-merge)
    for name in mask-branch pivot-mma channel-k channel-v wide-eight; do bash "$0" pending "$name"; done ;;
  defaults)  # the CuTe kernels' GPU suites with the switches as they ship ($JOBS pytest processes)
    parallel_pytest defaults "python3 -m pytest" "tests/test_cute_decode.py tests/test_cute_variants.py tests/test_multitoken.py \
      tests/test_cute_channel_e4m3.py tests/test_cute_channel_v_pair.py tests/test_steps_windows.py tests/test_cute_mask_branch.py \
      tests/test_cute_wgmma.py" ;;
  wide-eight-speed)  # after install-cute and the wide-eight tests: one CTA an SM of three consumers at 8 columns
                     # (WIDE_EIGHT_COLUMNS) against foscar.decode's launch and v1 at one and two CTAs (kernel alone):
                     # GQA 4 (two tiles a pass) on the short and read-share shapes, GQA 8 (one); then steps of 2 tokens
    timeout 300 python3 benchmarks/sweep_cute.py --shapes 1:8K 1:32K 1:128K 8:8K 8:32K 64:8K --bits 2 4 \
      --variants tuned v1x2 v1 v1w --splits 1 1.5 2 > "$OUT/sweep-wide-eight.log" 2>&1
    echo "wide-eight GQA 4 rc=$?"; grep BEST "$OUT/sweep-wide-eight.log"
    timeout 120 python3 benchmarks/sweep_cute.py --shapes 8:32K 8:128K --bits 2 4 --kv-heads 4 \
      --variants tuned v1x2 v1w --splits 1 2 > "$OUT/sweep-wide-eight-gqa8.log" 2>&1
    echo "wide-eight GQA 8 rc=$?"; grep BEST "$OUT/sweep-wide-eight-gqa8.log"
    for v in "" "MASK_BRANCH=1" "MASK_BRANCH=1 WIDE_EIGHT_COLUMNS=1 TWO_CTA_COLUMNS=16"; do
      tag=$(echo "$v" | awk '{print NF}')
      timeout 150 python3 benchmarks/run_with.py $v -- benchmarks/bench_steps.py --shapes 8:32K,64:32K --bits 2 4 \
        --q-len 1 2 --backends auto > "$OUT/steps-two-$tag.md" 2>&1
      echo "steps of 2 $v rc=$?"; tail -6 "$OUT/steps-two-$tag.md"
    done ;;
  steps-switches)  # steps-switches [VARIANT ...]: bench_steps.py (B 8 and 64, L 32K, STEPS_BITS default 2 4, one token
                   # and a step of 8; STEPS_ARGS more of its arguments) as shipped, with each variant (run_with.py's
                   # words), then shipped again
    shift; i=0
    for v in "" "$@" ""; do
      timeout 240 python3 benchmarks/run_with.py $v -- benchmarks/bench_steps.py --shapes 8:32K,64:32K \
        --bits ${STEPS_BITS:-2 4} --q-len 1 8 --backends auto ${STEPS_ARGS:-} > "$OUT/steps-switches-$i.md" 2>&1
      echo "steps [${v:-shipped}] rc=$?"; grep "^| " "$OUT/steps-switches-$i.md" | tail -8; i=$((i + 1))
    done ;;
  switches)  # switches WHEELS [VARIANT ...]: each variant one argument of run_with.py words
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?switches needs the FlashInfer wheels folder}"/*.whl
    shift 2
    timeout 500 python3 benchmarks/sweep_switches.py --variants shipped "${@:-COMBINE_PDL=1}" \
      --choose /tmp/foscar-variant > "$OUT/sweep-switches.md" 2>&1
    echo "sweep rc=$?"; tail -4 "$OUT/sweep-switches.md" ;;
  retune)
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    v="$(cat /tmp/foscar-variant 2>/dev/null)"; echo "switches: ${v:-shipped}"
    timeout 300 python3 benchmarks/run_with.py $v -- foscar.tune --backend cute --preset paper --bits 2 4 \
      --out foscar/tuning > "$OUT/tune-cute.md" 2> "$OUT/tune-cute.log"; echo "tune rc=$?"
    cp foscar/tuning/*.json "$OUT/" 2>/dev/null
    timeout 240 python3 benchmarks/run_with.py $v -- foscar.bench.decode --grid paper --cuda-graph \
      --kernels foscar_auto flashinfer_tc --out "$OUT/paper" > "$OUT/paper.log" 2>&1; echo "paper rc=$?"
    grep "^Geomean" "$OUT/paper.log" ;;
  cluster-merge)  # after install-cute: the split merge in a cluster, one decode a process under a timeout; its GPU
                  # tests only where every smoke case came back
    timeout 150 python3 benchmarks/cluster_smoke.py --timeout 120 > "$OUT/cluster-smoke.log" 2>&1; cat "$OUT/cluster-smoke.log"
    grep -q "TIMEOUT\|rc [1-9]" "$OUT/cluster-smoke.log" || JOBS=${JOBS:-8} bash "$0" pending cluster-merge ;;
  fi-parts)  # fi-parts DIR: install FlashInfer from its wheel cut into parts (DIR/fi-part-*, joined in name order,
             # carried over several calls: the wheel and the tree exceed one call's 64 MiB) and DIR's other wheels.
             # A call's carry can drop the parts an earlier call carried beside them: copy each call's parts to DIR
             # (outside the tree, e.g. /tmp/fiw) in the call that carries them
    d="${2:?fi-parts needs the folder of the parts}"
    cat "$d"/fi-part-* > "$d/flashinfer_python-0.7.2.post1-py3-none-any.whl"
    python3 -m pip install -q --no-index --no-deps --no-compile "$d"/*.whl
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" ;;
  ab|ab-axes)  # after install-cute: foscar.decode (auto) from two checkouts, BASE (a folder holding another commit's
               # foscar package, carried in untracked) then this one, then BASE again, each `python3 -m
               # foscar.bench.decode ARGS --kernels foscar_auto --cuda-graph`; compare_kernels.py sets the runs side by
               # side. ab BASE [ARGS ...] (default: the axes grid at 1:128K,8:32K,8:128K); ab-axes BASE [SHAPES] [BITS]
    base="$2"; root="$PWD"
    if [ "$1" = ab-axes ]; then set -- --grid axes --shapes "${3:-1:128K,8:32K,8:128K}" --bits ${4:-2 4}
    else shift 2; [ $# -eq 0 ] && set -- --grid axes --shapes 1:128K,8:32K,8:128K; fi
    for run in base new base2; do
      dir="$root"; [ "$run" != new ] && dir="$root/$base"
      (cd "$dir" && timeout 280 python3 -m foscar.bench.decode "$@" --kernels foscar_auto --cuda-graph \
        --out "$OUT/ab-$run" > "$OUT/ab-$run.log" 2>&1); echo "$run rc=$?"
    done
    python3 benchmarks/compare_kernels.py "$OUT"/ab-{base,new,base2}/bench_decode.json --labels base new base2 \
      --kernels foscar_auto@base foscar_auto@new foscar_auto@base2 | tee "$OUT/ab.md" ;;
  grid)  # after install-cute and fi-parts: foscar.decode (auto) beside FlashInfer BF16 in one process each: the
          # paper grid, the axes grid, the GQA sweep (B 8, L 128K, Hq 32) and steps of 1-8 tokens (grid [PART ...]:
          # paper axes heads steps, default all; HEADS names the ratios of the sweep, default all six); with TUNE_DIR
          # set, its entries first (tune-more's), then the shipped file's
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    [ -n "${TUNE_DIR:-}" ] && export FOSCAR_TUNING_DIR="$TUNE_DIR"
    shift; parts="${*:-paper axes heads steps}"
    case " $parts " in *" paper "*)
      timeout 200 python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_auto flashinfer_tc \
        --out "$OUT/paper" > "$OUT/paper.log" 2>&1; echo "paper rc=$?"; grep "^Geomean" "$OUT/paper.log" ;; esac
    case " $parts " in *" axes "*)
      timeout 120 python3 -m foscar.bench.decode --grid axes --cuda-graph --kernels foscar_auto flashinfer_tc \
        --out "$OUT/axes" > "$OUT/axes.log" 2>&1; echo "axes rc=$?" ;; esac
    case " $parts " in *" heads "*) for h in ${HEADS:-32:1 32:2 32:4 32:8 32:16 32:32}; do
      timeout 100 python3 -m foscar.bench.decode --shapes 8:128K --heads $h --cuda-graph --kernels foscar_auto \
        flashinfer_tc --out "$OUT/heads/${h/:/-}" > "$OUT/heads-${h/:/-}.log" 2>&1
      echo "heads $h rc=$? $(grep "done in" "$OUT/heads-${h/:/-}.log")"
    done ;; esac
    case " $parts " in *" steps "*)
      timeout 200 python3 benchmarks/bench_steps.py --shapes 8:32K,8:128K,64:32K,64:128K --bits 2 4 --q-len 1 2 4 8 \
        --backends auto > "$OUT/steps.md" 2>&1; echo "steps rc=$?"; grep "^| " "$OUT/steps.md" | tail -50 ;; esac ;;
  tune-more)  # after install-cute: foscar tune (CuTe) into TUNE_DIR (default /tmp/tun, kept between calls) for INT4's
               # paper shapes, GQA 16 and 32 (B 8, L 128K), steps of 2-8 tokens at the steps bars' shapes and the
               # channel-wise axes of the axes grid; tune-more [PART ...] (paper4 gqa steps axes; default all: over one
               # call's 600 s where every candidate compiles, so a call takes two or three parts); merge the file it
               # copies to $OUT into foscar/tuning/<GPU>.json
    d="${TUNE_DIR:-/tmp/tun}"; mkdir -p "$d"; shift; parts="${*:-paper4 gqa steps axes}"
    case " $parts " in *" paper4 "*)
      timeout 150 python3 -m foscar.tune --backend cute --preset paper --bits 4 --out "$d" \
        > "$OUT/tune-cute-paper-4.md" 2> "$OUT/tune-cute-paper-4.log"; echo "paper INT4 rc=$?" ;; esac
    case " $parts " in *" gqa "*) for h in 32:1 32:2; do
      timeout 90 python3 -m foscar.tune --backend cute --shapes 8:128K --heads $h --bits 2 4 --out "$d" \
        >> "$OUT/tune-cute-gqa.md" 2>> "$OUT/tune-cute-gqa.log"; echo "GQA $h rc=$?"
    done ;; esac
    case " $parts " in *" steps "*)
      timeout 240 python3 -m foscar.tune --backend cute --shapes 8:32K 8:128K 64:32K 64:128K --bits 2 4 --q-len 2 4 8 \
        --out "$d" > "$OUT/tune-cute-steps.md" 2> "$OUT/tune-cute-steps.log"; echo "steps rc=$?" ;; esac
    case " $parts " in *" axes "*)
      for axes in "--k-axis token --v-axis channel" "--k-axis channel --v-axis token channel"; do
        timeout 150 python3 -m foscar.tune --backend cute --shapes 1:32K 1:128K 8:32K 8:128K --bits 2 4 $axes \
          --out "$d" >> "$OUT/tune-cute-axes.md" 2>> "$OUT/tune-cute-axes.log"; echo "axes ($axes) rc=$?"
      done ;; esac
    cp "$d"/*.json "$OUT/" ;;
  triton-gqa)  # after fi-parts: foscar tune --backend triton at GQA 16 and 32 (B 8, L 128K, Hq 32), then the Triton
               # kernel with those entries beside FlashInfer BF16, one process a ratio
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    for h in 32:1 32:2; do
      timeout 240 python3 -m foscar.tune --backend triton --shapes 8:128K --heads $h --bits 2 4 --out foscar/tuning \
        > "$OUT/tune-triton-${h/:/-}.md" 2> "$OUT/tune-triton-${h/:/-}.log"; echo "tune $h rc=$?"
      timeout 120 python3 -m foscar.bench.decode --shapes 8:128K --heads $h --cuda-graph --kernels foscar_folded \
        flashinfer_tc --out "$OUT/triton-heads/${h/:/-}" > "$OUT/triton-heads-${h/:/-}.log" 2>&1
      echo "heads $h rc=$? $(grep "done in" "$OUT/triton-heads-${h/:/-}.log")"
    done
    cp foscar/tuning/*.json "$OUT/" 2>/dev/null ;;
  fa4)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?fa4 needs the flash-attn-4, quack and tvm-ffi wheels}"/*.whl
    python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_folded cudnn_sdpa fa4 --out "$OUT/fa4" \
      > "$OUT/fa4.log" 2>&1; grep "done in" "$OUT/fa4.log" ;;
  *)
    echo "unknown step $step" >&2; exit 2 ;;
esac
tar czf "$OUT/$step.tgz" -C "$OUT" --exclude="*.tgz" . 2>/dev/null
