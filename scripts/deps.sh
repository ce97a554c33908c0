#!/bin/sh
# Installs what ctrain needs to build and test, from Debian's packages, when
# it is missing.  Says what it installs; does nothing when all is present.
set -e
missing=""
need() { # need PACKAGE TEST-COMMAND...
    pkg=$1; shift
    if ! "$@" >/dev/null 2>&1; then missing="$missing $pkg"; fi
}
need pkg-config       command -v pkg-config
need libopenmpi-dev   test -f /usr/lib/x86_64-linux-gnu/pkgconfig/ompi-c.pc -o -n "$(ls /usr/lib/*/openmpi/include/mpi.h 2>/dev/null)"
need openmpi-bin      command -v mpirun
need libopenblas-dev  test -n "$(ls /usr/include/*/openblas-pthread/cblas.h /usr/include/*/cblas.h 2>/dev/null | head -1)"
need zlib1g-dev       test -f /usr/include/zlib.h
need dataset-fashion-mnist test -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
[ -z "$missing" ] && exit 0
echo "ctrain: installing missing Debian packages:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing
