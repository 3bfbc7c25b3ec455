#!/usr/bin/env bash
# Build kvflow's base image, a minimal Debian bookworm with python3 + venv + g++, from scratch:
# no registry pull (none is reachable here). debootstrap writes a rootfs from the apt
# mirror this machine already uses, the security updates are applied in a chroot, and
# `docker import` turns the tree into an image.
#
#   docker/build_base_image.sh [--force]
#
# Also fetched while the chroot has apt lists: the .deb files that Debian's `prometheus`
# package needs on top of this base ($KVFLOW_DOCKER_CACHE/prometheus-debs), so the
# Prometheus image installs them with no network inside `docker build`.
#
# Idempotent: an existing image (and a complete deb folder) is kept unless --force.
# Environment: KVFLOW_BASE_IMAGE (default kvflow-base:bookworm), KVFLOW_DOCKER_CACHE
# (default ~/.cache/kvflow-docker), KVFLOW_DEBIAN_MIRROR (default: this machine's).
set -euo pipefail

BASE_IMAGE="${KVFLOW_BASE_IMAGE:-kvflow-base:bookworm}"
CACHE="${KVFLOW_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvflow-docker}"
SUITE=bookworm
# tini: PID 1 of the kvflow containers. A role that is still loading keeps SIGTERM's
# default action, which the kernel never applies to a namespace's PID 1 (docker stop
# would wait for SIGKILL); under tini the role is PID 2 and stops at once.
# g++: kvflow compiles its native CPU kernels (kernels/cpu/*.cpp) for the host CPU.
PACKAGES=python3,python3-venv,ca-certificates,tini,g++
DEBS="$CACHE/prometheus-debs"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

log() { printf '[build_base_image %4ds] %s\n' "$SECONDS" "$*" >&2; }

debian_mirror() {
    # The first Debian archive (not -security) named in this machine's apt sources.
    if [[ -n "${KVFLOW_DEBIAN_MIRROR:-}" ]]; then echo "$KVFLOW_DEBIAN_MIRROR"; return; fi
    local uri
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null | grep -v "^[[:space:]]*#" \
        | grep -Eo '(https?://[^ ]+/debian)/?( |$)' | grep -v security | head -n1 | tr -d ' ' || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

built_with=$(docker image inspect --format '{{index .Config.Labels "org.kvflow.base.packages"}}' \
    "$BASE_IMAGE" 2>/dev/null || true)
if [[ $FORCE == 0 && "$built_with" == "$PACKAGES" && -f "$DEBS/.complete" ]]; then
    log "$BASE_IMAGE ($PACKAGES) and $DEBS exist: nothing to do (--force rebuilds)"
    exit 0
fi

command -v debootstrap >/dev/null || {
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
}

MIRROR=$(debian_mirror)
SECURITY="${MIRROR%/debian}/debian-security"
mkdir -p "$CACHE"
ROOTFS=$(mktemp -d "$CACHE/rootfs.XXXXXX")
chmod 0755 "$ROOTFS"  # apt's sandbox user must reach the chroot's archive folder
cleanup() {
    mountpoint -q "$ROOTFS/proc" && umount "$ROOTFS/proc"
    rm -rf "$ROOTFS"
}
trap cleanup EXIT

log "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 30 "$CACHE/debootstrap.log" >&2; exit 1; }

cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
# As Debian's own container images do: no service is started by a package's postinst,
# and no docs or apt caches are kept.
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"
chmod +x "$ROOTFS/usr/sbin/policy-rc.d"
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/kvflow-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
echo 'APT::Install-Recommends "false";' >"$ROOTFS/etc/apt/apt.conf.d/90kvflow-no-recommends"

APT_LOG="$CACHE/base-apt.log"
in_root() {
    chroot "$ROOTFS" env DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@" >>"$APT_LOG" 2>&1 \
        || { tail -n 30 "$APT_LOG" >&2; log "failed in the chroot: $*"; exit 1; }
}
: >"$APT_LOG"
mount -t proc proc "$ROOTFS/proc"
log "security updates"
in_root apt-get update -q
in_root apt-get -y -q upgrade

log "downloading prometheus and the packages it needs on top of the base"
in_root apt-get clean
in_root apt-get install -y -q --download-only prometheus
rm -rf "$DEBS" && mkdir -p "$DEBS"
mv "$ROOTFS"/var/cache/apt/archives/*.deb "$DEBS"/
touch "$DEBS/.complete"

in_root apt-get clean
umount "$ROOTFS/proc"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log \
    "$ROOTFS"/usr/share/doc/*/[!c]* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
find "$ROOTFS/usr/lib/python3"* -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
: >"$ROOTFS/etc/resolv.conf"  # the host's resolver is no business of the image

log "importing $BASE_IMAGE"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --change "LABEL org.kvflow.base.packages=$PACKAGES" \
    --message "debootstrap $SUITE ($PACKAGES) from $MIRROR" \
    - "$BASE_IMAGE" >/dev/null
# The base this one replaced, once nothing is built on it any more.
docker image prune -f --filter label=org.kvflow.base.packages >/dev/null
log "done: $(docker image inspect "$BASE_IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}')"
