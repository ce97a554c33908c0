# ctrain build.  `make` builds the library, the ctrain program and ctrain.pc;
# `make test` runs every test (unit tests, then the multi-rank suite under
# mpirun at 2, 3 and 4 ranks); `make sanitize` runs them under ASan+UBSan;
# `make bench` runs the benchmarks; `make run` trains the default model,
# `make run-gpt` a small GPT on text.
# Missing Debian packages are installed first by scripts/deps.sh.

B       ?= build
PREFIX  ?= /usr/local
# Flags are expanded lazily (=), after scripts/deps.sh has installed pkg-config.
PKGS     = openblas ompi-c zlib
CFLAGS  ?= -O3 -march=native -fno-math-errno -g
XCFLAGS  = -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fPIC -pthread -Iinclude -Isrc \
           $(shell pkg-config --cflags $(PKGS)) $(SANFLAGS)
# oneDNN (bf16 matmul) ships no .pc file; its header is <oneapi/dnnl/dnnl.h>
# under /usr/include.  It runs on OpenMP (libgomp), whose thread count we set.
DNNL_LIBS = -ldnnl -lgomp
LDLIBS   = $(shell pkg-config --libs $(PKGS)) $(DNNL_LIBS) -lm -pthread

LIB_SRC   := $(sort $(wildcard src/*/*.c))
CLI_SRC   := $(sort $(wildcard cli/*.c))
TEST_SRC  := $(sort $(wildcard tests/test_*.c))
MPI_SRC   := $(sort $(wildcard tests/mpi/*.c))
BENCH_SRC := $(sort $(wildcard bench/*.c))

LIB_OBJ   = $(LIB_SRC:%.c=$(B)/%.o)
CLI_OBJ   = $(CLI_SRC:%.c=$(B)/%.o)
TEST_OBJ  = $(TEST_SRC:%.c=$(B)/%.o) $(B)/tests/harness.o $(B)/tests/runner.o $(B)/tests/cli_util.o
MPI_OBJ   = $(MPI_SRC:%.c=$(B)/%.o) $(B)/tests/harness.o
BENCHES   = $(BENCH_SRC:bench/%.c=$(B)/bench/%)
DEPS_OK   = $(B)/.deps-ok

NP      ?= 2,3,4
MPIRUN   = OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe --bind-to none

.PHONY: all test sanitize fuzz bench run run-gpt install clean deps
all: $(B)/libctrain.a $(B)/libctrain.so $(B)/ctrain $(B)/ctrain.pc

deps: $(DEPS_OK)
$(DEPS_OK): scripts/deps.sh
	@mkdir -p $(B)
	@sh scripts/deps.sh
	@touch $@

# `make V=1` shows whole compiler command lines.
Q = $(if $(V),,@)

$(B)/%.o: %.c | $(DEPS_OK)
	@mkdir -p $(dir $@)
	$(if $(V),,@echo "CC $<")
	$(Q)$(CC) $(CFLAGS) $(XCFLAGS) -MMD -MP -c $< -o $@

$(B)/libctrain.a: $(LIB_OBJ)
	rm -f $@ && ar rcs $@ $^

$(B)/libctrain.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(SANFLAGS) $(LDLIBS)

$(B)/ctrain: $(CLI_OBJ) $(B)/libctrain.a
	$(CC) -o $@ $(CLI_OBJ) $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

$(B)/ctrain.pc: scripts/ctrain.pc.in
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(shell sed -n 's/#define CT_VERSION "\(.*\)"/\1/p' include/ctrain/core.h)|' $< > $@

$(B)/tests/run: $(TEST_OBJ) $(B)/libctrain.a
	$(CC) -o $@ $(TEST_OBJ) $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

$(B)/tests/mpi_run: $(MPI_OBJ) $(B)/libctrain.a
	$(CC) -o $@ $(MPI_OBJ) $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

# A user's program with a constructor, linked with libctrain statically and
# as a shared library (tests/test_core_blas.c checks it starts untouched).
$(B)/tests/ctor_prog: $(B)/tests/ctor_prog.o $(B)/libctrain.a
	$(CC) -o $@ $< $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

$(B)/tests/ctor_prog_so: $(B)/tests/ctor_prog.o $(B)/libctrain.so
	$(CC) -o $@ $< -L$(B) -lctrain -Wl,-rpath,'$$ORIGIN/..' $(SANFLAGS) $(LDLIBS)

# Ranks that call different collectives (the collective fingerprint test).
$(B)/tests/fp_prog: $(B)/tests/fp_prog.o $(B)/libctrain.a
	$(CC) -o $@ $< $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

$(B)/bench/%: $(B)/bench/%.o $(B)/libctrain.a
	$(CC) -o $@ $< $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

# Each test (and each multi-rank suite) may take up to 300 s: the kill-during-save
# loops run dozens of short trainings, slow on a loaded 2-core machine.
test: all $(B)/tests/run $(B)/tests/mpi_run $(B)/tests/ctor_prog $(B)/tests/ctor_prog_so $(B)/tests/fp_prog
	$(B)/tests/run --timeout 300 --mpi $(B)/tests/mpi_run --np $(NP) $(T)

# Same tests under AddressSanitizer + UndefinedBehaviorSanitizer in build-san/.
# Open MPI's own allocations at exit are not ours to chase: the multi-rank
# suite runs without leak detection (tests/mpi/suppress in ASAN_OPTIONS there).
sanitize:
	$(MAKE) B=build-san CFLAGS="-O1 -g" \
	    SANFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" test

# libFuzzer targets for every parser (tests/fuzz), with clang from Debian
# (scripts/fuzz.sh installs it when missing; `make test` never needs it).
fuzz:
	sh scripts/fuzz.sh

bench: all $(BENCHES)
	@for b in $(BENCHES); do echo "== $$b"; $$b || exit 1; done
	@echo "== bench/fsdp"; bench/fsdp
	@echo "== bench/compare-pytorch"; bench/compare-pytorch
	@echo "== bench/gpt"; bench/gpt
	@echo "== bench/cluster"; bench/cluster

run: all
	sh scripts/run.sh

# A small GPT on the fortunes text over 2 ranks: validation loss vs the unigram baseline, and a sample.
run-gpt: all
	sh scripts/run-gpt.sh

install: all
	install -d $(PREFIX)/lib $(PREFIX)/include/ctrain $(PREFIX)/bin $(PREFIX)/lib/pkgconfig
	install -m 644 $(B)/libctrain.a $(B)/libctrain.so $(PREFIX)/lib
	install -m 644 include/ctrain/*.h $(PREFIX)/include/ctrain
	install -m 755 $(B)/ctrain $(PREFIX)/bin
	install -m 644 $(B)/ctrain.pc $(PREFIX)/lib/pkgconfig

clean:
	rm -rf build build-san build-fuzz

-include $(shell find $(B) -name '*.d' 2>/dev/null)
