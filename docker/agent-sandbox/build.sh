#!/bin/sh
# Build the agent sandbox's base image from Debian packages, without Docker Hub: a minimal Debian (debootstrap,
# variant minbase) with python3 (the sandbox runs its forwarder with it; stdlib agents run on it too), imported
# with `docker import`. Idempotent: does nothing when the image already exists (FORCE=1 rebuilds).
#
#   docker/agent-sandbox/build.sh [TAG]        # default rollout-buffer/agent-sandbox:bookworm
#
# Needs root (debootstrap), `debootstrap` (apt-get install debootstrap), a running Docker engine and an
# apt mirror (DEBIAN_MIRROR, default http://deb.debian.org/debian). EXTRA_PACKAGES adds Debian packages
# (comma-separated, e.g. "python3-pip,git"). Derive your agent's image from it (see README "Agents").
set -eu

TAG="${1:-rollout-buffer/agent-sandbox:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3${EXTRA_PACKAGES:+,$EXTRA_PACKAGES}"

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG already exists (FORCE=1 to rebuild)"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "no Docker engine answers (docker info fails)" >&2; exit 1; }

ROOTFS="$(mktemp -d /tmp/rb-agent-rootfs-XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT INT TERM
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR"
# What the image does not need at run time: package caches, lists, documentation.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
    "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
chroot "$ROOTFS" python3 -c 'import json, socket, urllib.request'  # what forward.py and stdlib agents use
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$TAG"
echo "built $TAG"
