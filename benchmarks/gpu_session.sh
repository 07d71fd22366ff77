#!/usr/bin/env bash
# Validate and measure foscar on a GPU machine, from a checkout (nothing installed): the GPU tests,
# then optionally the tuner, the speed benchmark and the accuracy study. Each step writes under $OUT
# and prints a short summary; a failing step does not stop the later ones.
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh tests            # GPU tests (Triton, API, append, CLI, HF, SASS)
#   OUT=/tmp/out bash benchmarks/gpu_session.sh cute BUNDLE_DIR  # install cutlass-dsl, then the CuTe tests
#   OUT=/tmp/out bash benchmarks/gpu_session.sh tune             # foscar tune --preset paper -> tuning/configs
#   OUT=/tmp/out bash benchmarks/gpu_session.sh speed WHEELS     # install FlashInfer, paper + axes grids
#   OUT=/tmp/out bash benchmarks/gpu_session.sh accuracy         # the stress study on the GPU backends
#   OUT=/tmp/out bash benchmarks/gpu_session.sh heads WHEELS     # the GQA sweep (paper Fig. 15), FlashInfer baseline
#   OUT=/tmp/out bash benchmarks/gpu_session.sh fa4 WHEELS       # FlashAttention-4 (cutlass-dsl installed first by
#                                                                #   the cute step on the same warm machine)
#
# Each step also packs its outputs into $OUT/<step>.tgz: a reply brings back a limited number of files.
#
# The install steps take the offline bundles described in ../shared/device/README.md (cutlass-dsl) and
# benchmarks/bench_decode.py's docstring (FlashInfer wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/foscar-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step="${1:?usage: gpu_session.sh tests|cute BUNDLE|tune|speed WHEELS|accuracy|heads WHEELS|fa4 WHEELS}"
case "$step" in
  tests)  # one pytest per file, each with its summary line (a timeout loses at most the file it was in)
    for f in tests/test_triton.py tests/test_api.py tests/test_append.py tests/test_cli.py tests/test_transformers.py \
             tests/test_sass.py; do
      python3 -m pytest -q "$f" > "$OUT/tests-$(basename "$f" .py).log" 2>&1
      echo "$f: $(tail -1 "$OUT/tests-$(basename "$f" .py).log")"
    done ;;
  cute)
    bundle="${2:?cute needs the cutlass-dsl bundle folder (install-cute-dsl.sh beside it)}"
    bash "$(dirname "$bundle")/install-cute-dsl.sh" "$bundle" > "$OUT/cute-install.log" 2>&1
    python3 -m pytest -q -s tests/test_cute_decode.py tests/test_cute_fragment.py > "$OUT/cute.log" 2>&1
    grep -E "error|passed|failed" "$OUT/cute.log" | tail -12
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    for kind in cute cute_ws; do for tool in memcheck racecheck synccheck; do
      timeout 120 "$CS" --tool $tool --report-api-errors no --error-exitcode 1 python3 benchmarks/sanitize_one.py $kind \
        > "$OUT/sanitize-$kind-$tool.log" 2>&1; echo "$kind $tool rc=$? $(tail -1 "$OUT/sanitize-$kind-$tool.log")"
    done; done
    python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_folded foscar_cute foscar_cute_ws \
      --out "$OUT/cute-bench" > "$OUT/cute-bench.log" 2>&1; grep "done in" "$OUT/cute-bench.log" ;;
  tune)
    python3 -m foscar.tune --preset paper --bits 2 4 --out tuning/configs > "$OUT/tune.md" 2> "$OUT/tune.log"
    tail -30 "$OUT/tune.md"; cp tuning/configs/*.json "$OUT/" 2>/dev/null ;;
  speed)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?speed needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    python3 -m foscar.bench.decode --grid paper --cuda-graph --out "$OUT/paper" --kernels foscar_folded \
      foscar_reconstruct flashinfer_tc cudnn_sdpa flashinfer_fp8 flashinfer_nvfp4 foscar_cute > "$OUT/paper.log" 2>&1
    python3 -m foscar.bench.decode --grid axes --cuda-graph --kernels foscar_folded flashinfer_tc --out "$OUT/axes" \
      > "$OUT/axes.log" 2>&1
    grep -A8 "^| bar" "$OUT/paper.log"; grep "^Geomean" "$OUT/paper.log"
    python3 -m foscar.bench.cli plot "$OUT/paper/bench_decode.json" "$OUT/axes/bench_decode.json" --out "$OUT" ;;
  accuracy)
    python3 -m foscar.bench.cli accuracy --backend triton --out "$OUT/accuracy-triton" > "$OUT/accuracy.log" 2>&1
    tail -14 "$OUT/accuracy.log" ;;
  heads)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?heads needs the FlashInfer wheels folder}"/*.whl
    export FLASHINFER_WORKSPACE_BASE=/tmp/fi
    for h in 32:1 32:2 32:4 32:8 32:16 32:32; do  # the first run JIT-compiles FlashInfer's module per head ratio
      python3 -m foscar.bench.decode --shapes 8:128K --heads $h --cuda-graph --kernels foscar_folded flashinfer_tc \
        --out "$OUT/heads/${h/:/-}" > "$OUT/heads-${h/:/-}.log" 2>&1; echo "$h rc=$?"
    done
    python3 -m foscar.bench.cli plot "$OUT"/heads/*/bench_decode.json --out "$OUT/heads" --name heads ;;
  fa4)
    python3 -m pip install -q --no-index --no-deps --no-compile "${2:?fa4 needs the flash-attn-4, quack and tvm-ffi wheels}"/*.whl
    python3 -m foscar.bench.decode --grid paper --cuda-graph --kernels foscar_folded cudnn_sdpa fa4 --out "$OUT/fa4" \
      > "$OUT/fa4.log" 2>&1; grep "done in" "$OUT/fa4.log" ;;
  *)
    echo "unknown step $step" >&2; exit 2 ;;
esac
tar czf "$OUT/$step.tgz" -C "$OUT" --exclude="*.tgz" . 2>/dev/null
