#!/bin/sh
# Installs what ctrain needs to build and test, from Debian's packages, when
# it is missing.  Says what it installs; does nothing when all is present.
#   scripts/deps.sh        everything (the Makefile runs it first)
#   scripts/deps.sh plot   gnuplot only (scripts/plot runs it when gnuplot is missing)
set -e
missing=""
need() { # need PACKAGE TEST-COMMAND...
    pkg=$1; shift
    if ! "$@" >/dev/null 2>&1; then missing="$missing $pkg"; fi
}
# scripts/plot draws with gnuplot (-nox: no X11, its PNG terminals only)
need gnuplot-nox      command -v gnuplot
if [ "${1:-}" != plot ]; then
    need pkg-config       command -v pkg-config
    # pkg-config is what the Makefile asks, so it is what decides (a stray header
    # without its .pc file once hid a missing libopenblas-dev).
    need libopenmpi-dev   pkg-config --exists ompi-c
    need openmpi-bin      command -v mpirun
    need libopenblas-dev  pkg-config --exists openblas
    need zlib1g-dev       pkg-config --exists zlib
    need libdnnl-dev      test -f /usr/include/oneapi/dnnl/dnnl.h
    need dataset-fashion-mnist test -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
    # byte-level text for the GPT (--data fortunes): fortune's cookie files
    need fortunes         test -f /usr/share/games/fortunes/fortunes
    # scripts/cluster's hosts: ip (namespaces, veth, the bridge) and tc (link rates)
    need iproute2         command -v tc
fi
[ -z "$missing" ] && exit 0
echo "ctrain: installing missing Debian packages:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
# Another install may hold dpkg's lock (a shared machine): wait for it instead of failing.
# shellcheck disable=SC2086
$SUDO apt-get install -o DPkg::Lock::Timeout=600 -y -qq --no-install-recommends $missing
