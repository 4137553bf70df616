#!/bin/sh
# Base images for deploy/Dockerfile where no image registry is reachable: Debian bookworm
# root filesystems made by debootstrap from the host's Debian mirror, as two tarballs for
# `docker import`:
#
#   OUTDIR/base.tar   python3, python3-venv, python-is-python3 (the final stage: BASE_IMAGE)
#   OUTDIR/build.tar  the same plus g++ and python3-dev (the build stage: BUILD_IMAGE)
#
#   sudo deploy/base-image.sh /tmp/apex-base
#   docker import --change 'CMD ["/bin/bash"]' /tmp/apex-base/base.tar apex-base:bookworm
#   docker import --change 'CMD ["/bin/bash"]' /tmp/apex-base/build.tar apex-build:bookworm
#   docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=apex-base:bookworm \
#       --build-arg BUILD_IMAGE=apex-build:bookworm --build-arg WHEELHOUSE=wheelhouse -t apex .
#
# The build stage then needs no package index: g++ and the Python headers are in the image
# and pip installs from the wheelhouse (see deploy/Dockerfile). Needs root and debootstrap;
# takes about 80 s. The mirror is APEX_DEBIAN_MIRROR, else the first Debian mirror in the
# host's apt sources, else debootstrap's default.
set -eu

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
out=$1
suite=bookworm

# The host's Debian mirror (deb822 .sources or a one-line sources.list): the one apt already
# reaches here. Security and other archives are skipped: debootstrap needs the main archive.
host_mirror() {
    {
        cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '$1 == "URIs:" { for (i = 2; i <= NF; i++) print $i }'
        cat /etc/apt/sources.list 2>/dev/null | awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) { print $i; break } }'
    } | grep -E '/debian/?$' | head -n 1
}
mirror=${APEX_DEBIAN_MIRROR:-$(host_mirror || true)}

mkdir -p "$out"
root=$(mktemp -d "$out/rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT

# What apt downloads and documents is not needed at run time; dropping it halves the base.
slim() {
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/usr/share/locale/* "$root"/var/log/*.log "$root"/var/log/apt/*
}

# tar of the root filesystem without the host's DNS settings (docker provides its own).
pack() {
    rm -f "$root/etc/resolv.conf"
    tar --numeric-owner -C "$root" -cf "$1.part" . && mv "$1.part" "$1"
}

# $mirror unquoted on purpose: empty means debootstrap's default.
# shellcheck disable=SC2086
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3 "$suite" "$root" $mirror
slim
pack "$out/base.tar"

# The build stage's extras, installed into the same tree: the two images share the Python
# that the venv built in one stage and copied into the other points at.
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c \
    'apt-get update -q && apt-get install -y -q --no-install-recommends g++ python3-dev'
slim
pack "$out/build.tar"
echo "$out/base.tar $out/build.tar"
