#!/usr/bin/env bash
# The GPU checks (docs/benchmarks.md, "GPU checks"): on a machine with one CUDA GPU and no
# network, in under 8 minutes, run
#   - the greedy parity of the CUDA and CPU engines (tests/gpu, marker `cuda`),
#   - the CUDA-only kernel tests (pytest tests/kernels -m cuda),
#   - kvflow bench kernels, bench host-time (host ms per decode step at batch 1 and 64),
#     bench throughput (64 prompts x 256 -> 128 tokens) with CUDA graphs and with
#     --enforce-eager,
#   - two reports: where a decode step's time goes (decode_step_profile.py) and the
#     decode-attention kernel's launch choices (decode_attention_sweep.py),
#   - the Triton kernel tests compiled for the GPU (not interpreted), as time allows,
# and write one JSON of figures, OUTDIR/gpu_checks.json (tests/gpu/collect_gpu_checks.py).
#
# Usage: tests/gpu/run_gpu_checks.sh OUTDIR
# Python: $PYTHON, else the checkout's .venv, else python3. If `import kvflow` fails and
# tests/gpu/wheels exists, kvflow and its dependencies are installed from there (offline).
# Without CUDA every step is skipped with its reason and the script exits 0. With CUDA it
# exits 1 if a step failed or timed out, else 0; the JSON is written either way.
# KVFLOW_GPU_CHECKS_BUDGET_S (default 450) caps the whole run: a step gets at most what
# is left of it, and a step that would get under 20 s is skipped ("time budget").
set -u

OUT=${1:?usage: tests/gpu/run_gpu_checks.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT/raw"
OUT=$(cd "$OUT" && pwd)
RAW=$OUT/raw
rm -f "$RAW"/*
cd "$ROOT" || exit 1
BUDGET=${KVFLOW_GPU_CHECKS_BUDGET_S:-450}
START=$SECONDS

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python
else PY=python3
fi
WHEELS=tests/gpu/wheels
IMPORTS="import kvflow, pytest, torch"

STEPS="parity kernels_cuda bench_kernels host_time throughput_graphs throughput_eager
step_profile attention_sweep kernels_compiled"
# KVFLOW_GPU_CHECKS_ONLY="step ..." runs only those steps (a second run after a fix).
ONLY=${KVFLOW_GPU_CHECKS_ONLY:-}

skip_all() {  # reason
    for name in $STEPS; do echo "$1" > "$RAW/$name.skip"; done
}

finish() {  # exit status when no step failed
    "$PY" tests/gpu/collect_gpu_checks.py "$OUT" || python3 tests/gpu/collect_gpu_checks.py "$OUT"
    if [ "$1" = 0 ] && grep -q '"ok": false' "$OUT/gpu_checks.json"; then exit 1; fi
    exit "$1"
}

# A step: NAME LIMIT_S CMD...: stdout to NAME.out, stderr to NAME.log, status to NAME.rc.
run_step() {
    local name=$1 limit=$2 left t0
    shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        echo "not selected (KVFLOW_GPU_CHECKS_ONLY)" > "$RAW/$name.skip"
        return
    fi
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then
        echo "time budget: ${BUDGET} s spent before this step" > "$RAW/$name.skip"
        echo "== $name: skipped (time budget)"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit} s)"
    t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$RAW/$name.out" 2> "$RAW/$name.log"
    echo $? > "$RAW/$name.rc"
    echo $((SECONDS - t0)) > "$RAW/$name.secs"
    echo "   rc $(cat "$RAW/$name.rc") in $(cat "$RAW/$name.secs") s"
}

if ! "$PY" -c "$IMPORTS" 2> /dev/null && [ -d "$WHEELS" ]; then
    # --no-deps: the image's own torch, triton and transformers stay as they are (a
    # resolver run would try to replace them, and there is no index to take them from).
    echo "== install: the wheels in $WHEELS, then kvflow (no index, no dependency resolution)"
    { "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl &&
      "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" -e . ; } \
        > "$RAW/install.out" 2> "$RAW/install.log"
    echo $? > "$RAW/install.rc"
    echo "   done at $((SECONDS - START)) s"
fi
if ! "$PY" -c "$IMPORTS" 2> "$RAW/import.log"; then
    echo "kvflow, pytest or torch does not import with $PY (see $RAW/import.log; wheels: $WHEELS)"
    skip_all "kvflow, pytest or torch does not import with $PY"
    echo 1 > "$RAW/import.rc"
    finish 1
fi

"$PY" - > "$RAW/env.json" << 'EOF'
import json, platform, subprocess, torch
cuda = torch.cuda.is_available()
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
print(json.dumps({
    "cuda": cuda,
    "device": torch.cuda.get_device_name() if cuda else "cpu",
    "torch": torch.__version__,
    "cuda_version": torch.version.cuda,
    "python": platform.python_version(),
    "commit": commit.strip() or None,
}))
EOF
if ! grep -q '"cuda": true' "$RAW/env.json"; then
    echo "no CUDA device: the GPU checks are skipped (not a failure)"
    skip_all "no CUDA device"
    finish 0
fi

# Without the embedded model's wheel: a random-weight stand-in of its shape, built from
# the config and tokenizer in $WHEELS/embedded (tests/gpu/embedded_stand_in.py).
MODEL=()
if ! "$PY" -c "from kvflow.gpu_worker.model_files import embedded_gguf_path as p; p()" \
    2> /dev/null && [ -f "$WHEELS/embedded/config.json" ]; then
    echo "== the embedded model is not installed: a random-weight stand-in of its shape"
    "$PY" tests/gpu/embedded_stand_in.py build "$WHEELS/embedded" "$OUT/embedded-stand-in" \
        > "$RAW/stand_in.out" 2> "$RAW/stand_in.log"
    export KVFLOW_TEST_EMBEDDED_DIR=$OUT/embedded-stand-in
    MODEL=(--model "$KVFLOW_TEST_EMBEDDED_DIR")
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs)
KVFLOW=("$PY" -m kvflow.cli.main)
THROUGHPUT=(bench throughput --num-prompts 64 --input-len 256 --output-len 128 --json)
run_step parity 150 "${PYTEST[@]}" tests/gpu -m cuda --junitxml="$RAW/parity.xml"
run_step kernels_cuda 120 "${PYTEST[@]}" tests/kernels -m cuda --junitxml="$RAW/kernels_cuda.xml"
run_step bench_kernels 60 "${KVFLOW[@]}" bench kernels --json
run_step host_time 60 "${KVFLOW[@]}" bench host-time --batch-sizes 1 64 --json "${MODEL[@]}"
run_step throughput_graphs 75 "${KVFLOW[@]}" "${THROUGHPUT[@]}" "${MODEL[@]}"
run_step throughput_eager 75 "${KVFLOW[@]}" "${THROUGHPUT[@]}" "${MODEL[@]}" --enforce-eager
run_step step_profile 60 "$PY" tests/gpu/decode_step_profile.py "${MODEL[@]}"
run_step attention_sweep 100 "$PY" tests/gpu/decode_attention_sweep.py
# The Triton kernels against their references, compiled (on CPUs they run interpreted),
# over 8 pytest-xdist workers where it is installed: compiling dominates.
XDIST=()
"$PY" -c "import xdist" 2> /dev/null && XDIST=(-n 8)
run_step kernels_compiled 150 "${PYTEST[@]}" "${XDIST[@]}" -m "not slow" \
    --junitxml="$RAW/kernels_compiled.xml" \
    tests/kernels/test_paged_attention.py tests/kernels/test_store_kv.py \
    tests/kernels/test_triton_backend.py tests/kernels/test_engine_triton.py \
    tests/kernels/test_rotary.py tests/kernels/test_rms_norm.py \
    tests/kernels/test_activation.py tests/kernels/test_grammar_bitmask.py \
    tests/kernels/test_attention_sinks.py tests/kernels/test_fused_moe_options.py
finish 0
