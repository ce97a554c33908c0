#!/bin/sh
# `make fuzz`: builds the libFuzzer targets in tests/fuzz with clang
# (-fsanitize=fuzzer,address,undefined over the library's own sources, in
# build-fuzz/) and runs each on a copy of its seed corpus (tests/fuzz/corpus)
# for FUZZ_RUNS inputs (default 1000000) or FUZZ_SECONDS, whichever ends
# first, in FUZZ_JOBS parallel processes per target (default 1).  Installs
# Debian's clang and libFuzzer runtime first when missing, saying so.
# A crash, leak or undefined behaviour stops with the input saved under
# build-fuzz/crashes/<target>/; turn it into a test in tests/ and fix it.
#   make fuzz                      every target
#   make fuzz FUZZ=idx FUZZ_RUNS=10000
set -e
B=${B:-build-fuzz}
RUNS=${FUZZ_RUNS:-1000000}
SECONDS_MAX=${FUZZ_SECONDS:-1800}
TARGETS=${FUZZ:-"safetensors json idx index pieces args"}

probe() { printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n){(void)d;(void)n;return 0;}\n' |
          clang -x c -fsanitize=fuzzer,address,undefined -o /dev/null - >/dev/null 2>&1; }
if ! command -v clang >/dev/null 2>&1 || ! probe; then
    echo "ctrain: make fuzz needs clang with libFuzzer; installing Debian's clang libclang-rt-dev"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends clang libclang-rt-dev
    probe || { echo "ctrain: clang still cannot link -fsanitize=fuzzer" >&2; exit 1; }
fi

# The library, instrumented for coverage and sanitizers (the Makefile's rules, another compiler).
make -s B="$B" CC=clang CFLAGS="-O1 -g" \
     SANFLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
     "$B/libctrain.a"
FLAGS="-std=c11 -D_GNU_SOURCE -O1 -g -Iinclude -Isrc -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer $(pkg-config --cflags openblas ompi-c zlib)"
LIBS="$B/libctrain.a $(pkg-config --libs openblas ompi-c zlib) -ldnnl -lgomp -lm -pthread"
mkdir -p "$B/fuzz" "$B/crashes"
for t in $TARGETS; do
    extra=""
    [ "$t" = args ] && extra="cli/args.c cli/train_args.c cli/agree.c"
    echo "== fuzz_$t: building"
    # shellcheck disable=SC2086
    clang $FLAGS -o "$B/fuzz/fuzz_$t" "tests/fuzz/fuzz_$t.c" $extra $LIBS
    rm -rf "$B/fuzz/corpus_$t" && mkdir -p "$B/fuzz/corpus_$t" "$B/crashes/$t"
    cp tests/fuzz/corpus/"$t"/* "$B/fuzz/corpus_$t/" 2>/dev/null || true
    echo "== fuzz_$t: $RUNS inputs (at most $SECONDS_MAX s)"
    # Leak checks run in the targets themselves (the tracked allocator); LeakSanitizer
    # would also report Open MPI's own allocations at exit, which are not ours.
    ASAN_OPTIONS=detect_leaks=0 "$B/fuzz/fuzz_$t" -runs="$RUNS" -max_total_time="$SECONDS_MAX" -max_len=4096 \
        -artifact_prefix="$B/crashes/$t/" -print_final_stats=1 "$B/fuzz/corpus_$t" tests/fuzz/corpus/"$t" \
        2>"$B/fuzz/fuzz_$t.log" || { tail -40 "$B/fuzz/fuzz_$t.log"; echo "== fuzz_$t: FAILED (input in $B/crashes/$t/)"; exit 1; }
    grep -E "^stat::number_of_executed_units|^Done" "$B/fuzz/fuzz_$t.log" | tail -2
done
echo "== fuzz: every target ran without a crash"
