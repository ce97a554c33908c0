#!/bin/sh
# Installs ctrain into a temporary prefix and builds a program against the
# installed files only, as a user would (tests/test_examples.c runs it):
#   scripts/installcheck.sh BUILD-DIR SCRATCH-DIR
# Checks the installed .pc names its own prefix (twice: installing again
# elsewhere must give the new prefix), the SONAME and the library's links,
# and that the program, built with one pkg-config line, links the shared
# library, starts without LD_LIBRARY_PATH and trains.  Compiler and
# sanitizer flags come from BUILD-DIR/build.env (written by the Makefile).
set -e
B=$1
T=$2
[ -f "$B/build.env" ] || { echo "installcheck: $B/build.env is missing: run make B=$B first" >&2; exit 1; }
. "$B/build.env"
check_prefix() { # check_prefix PREFIX
    PKG_CONFIG_PATH="$1/lib/pkgconfig" PKG_CONFIG_DISABLE_UNINSTALLED=1 pkg-config --cflags --libs ctrain > "$T/flags"
    grep -q -- "-I$1/include" "$T/flags" || { echo "installcheck: $1's ctrain.pc gives: $(cat "$T/flags")" >&2; exit 1; }
    grep -q -- "-L$1/lib" "$T/flags" || { echo "installcheck: $1's ctrain.pc gives: $(cat "$T/flags")" >&2; exit 1; }
}
for p in "$T/first" "$T/second"; do
    make -s install B="$B" PREFIX="$p" >/dev/null
    check_prefix "$p"
done
lib=$T/second/lib
soname=$(readelf -d "$lib/libctrain.so" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
[ "$soname" = "libctrain.so.0" ] || { echo "installcheck: SONAME is '$soname', not libctrain.so.0" >&2; exit 1; }
[ -L "$lib/libctrain.so" ] && [ -L "$lib/libctrain.so.0" ] || { echo "installcheck: the .so links are missing" >&2; exit 1; }
# shellcheck disable=SC2086,SC2046
$CC $CFLAGS -std=c11 -Wall -Wextra -Werror $SANFLAGS -o "$T/custom_layer" examples/custom_layer.c \
    $(PKG_CONFIG_PATH="$lib/pkgconfig" PKG_CONFIG_DISABLE_UNINSTALLED=1 pkg-config --cflags --libs ctrain) -lm
rm -rf "$T/first" # the program must use the second prefix's library, found by its rpath
readelf -d "$T/custom_layer" | grep -q "NEEDED.*libctrain.so.0" || { echo "installcheck: not linked to libctrain.so.0" >&2; exit 1; }
mkdir -p "$T/run"
env -u LD_LIBRARY_PATH "$T/custom_layer" none "$T/run" 6
echo "installcheck: ok ($T/second)"
