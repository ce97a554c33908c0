# ctrain build.  `make` builds the library (static, and shared with a SONAME),
# the ctrain program, ctrain-uninstalled.pc (pkg-config from the build tree)
# and the examples;
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
XCFLAGS  = -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -fPIC -pthread -fopenmp -Iinclude -Isrc \
           $(shell pkg-config --cflags $(PKGS)) $(SANFLAGS)
# oneDNN (bf16 matmul) ships no .pc file; its header is <oneapi/dnnl/dnnl.h>
# under /usr/include.  It runs on OpenMP (libgomp), whose thread count we set.
DNNL_LIBS = -ldnnl -lgomp
LDLIBS   = $(shell pkg-config --libs $(PKGS)) $(DNNL_LIBS) -lm -pthread

LIB_SRC   := $(sort $(wildcard src/*/*.c src/*/*/*.c))
CLI_SRC   := $(sort $(wildcard cli/*.c))
TEST_SRC  := $(sort $(wildcard tests/test_*.c))
MPI_SRC   := $(sort $(wildcard tests/mpi/*.c))
BENCH_SRC := $(sort $(wildcard bench/*.c))
EX_SRC    := $(sort $(wildcard examples/*.c))

LIB_OBJ   = $(LIB_SRC:%.c=$(B)/%.o)
CLI_OBJ   = $(CLI_SRC:%.c=$(B)/%.o)
TEST_OBJ  = $(TEST_SRC:%.c=$(B)/%.o) $(B)/tests/harness.o $(B)/tests/runner.o $(B)/tests/cli_util.o
MPI_OBJ   = $(MPI_SRC:%.c=$(B)/%.o) $(B)/tests/harness.o
BENCHES   = $(BENCH_SRC:bench/%.c=$(B)/bench/%)
EXAMPLES  = $(EX_SRC:examples/%.c=$(B)/examples/%)
DEPS_OK   = $(B)/.deps-ok

NP      ?= 2,3,4
MPIRUN   = OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe --bind-to none

.PHONY: all test sanitize fuzz bench run run-gpt install clean deps
all: $(B)/libctrain.a $(B)/libctrain.so $(B)/ctrain $(B)/ctrain-uninstalled.pc $(EXAMPLES) $(B)/build.env

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

# The shared library is named for its version, with the SONAME (the major
# version: programs keep working across compatible releases) and the two
# usual links: libctrain.so.MAJOR for the loader, libctrain.so for -lctrain.
VERSION := $(shell sed -n 's/^\#define CT_VERSION "\(.*\)"/\1/p' include/ctrain/core.h)
SOMAJOR := $(firstword $(subst ., ,$(VERSION)))
$(B)/libctrain.so.$(VERSION): $(LIB_OBJ)
	$(CC) -shared -Wl,-soname,libctrain.so.$(SOMAJOR) -o $@ $^ $(SANFLAGS) $(LDLIBS)

$(B)/libctrain.so: $(B)/libctrain.so.$(VERSION)
	ln -sf libctrain.so.$(VERSION) $(B)/libctrain.so.$(SOMAJOR)
	ln -sf libctrain.so.$(SOMAJOR) $@

$(B)/ctrain: $(CLI_OBJ) $(B)/libctrain.a
	$(CC) -o $@ $(CLI_OBJ) $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

# pkg-config reads NAME-uninstalled.pc before NAME.pc, so with
# PKG_CONFIG_PATH=build `pkg-config --cflags --libs ctrain` compiles against
# this tree (headers in include/, the library in build/, an rpath to it).
# The installed ctrain.pc is written by `make install`, for its PREFIX.
PC_SED = -e 's|@VERSION@|$(VERSION)|' -e 's|@DESC@|Training neural networks across many workers in plain C (DDP, ZeRO, FSDP, pipeline) over MPI|'
$(B)/ctrain-uninstalled.pc: scripts/ctrain.pc.in Makefile include/ctrain/core.h
	sed $(PC_SED) -e 's|@PREFIX@|$(abspath .)|' -e 's|@INCLUDEDIR@|$(abspath include)|' -e 's|@LIBDIR@|$(abspath $(B))|' $< > $@

# How this build compiles, for scripts/installcheck.sh (a program built against
# an installed sanitizer build needs the same sanitizer flags).
$(B)/build.env: Makefile
	@mkdir -p $(B)
	@printf "CC='%s'\nCFLAGS='%s'\nSANFLAGS='%s'\n" "$(CC)" "$(CFLAGS)" "$(SANFLAGS)" > $@

# The examples compile as a user's program does: public headers only, flags
# from pkg-config (the uninstalled .pc); tests/test_examples.c runs them.
$(B)/examples/%: examples/%.c $(B)/libctrain.so $(B)/ctrain-uninstalled.pc
	@mkdir -p $(dir $@)
	$(if $(V),,@echo "CC $<")
	$(Q)$(CC) $(CFLAGS) -std=c11 -Wall -Wextra -Werror $(SANFLAGS) -o $@ $< \
	    $$(PKG_CONFIG_PATH=$(B) pkg-config --cflags --libs ctrain) -lm

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

# A collective call made on rank 0 only (tests/test_misuse.c).
$(B)/tests/misuse_prog: $(B)/tests/misuse_prog.o $(B)/libctrain.a
	$(CC) -o $@ $< $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

$(B)/bench/%: $(B)/bench/%.o $(B)/libctrain.a
	$(CC) -o $@ $< $(B)/libctrain.a $(SANFLAGS) $(LDLIBS)

# Each test (and each multi-rank suite) may take up to 300 s: the kill-during-save
# loops run dozens of short trainings, slow on a loaded 2-core machine.
test: all $(B)/tests/run $(B)/tests/mpi_run $(B)/tests/ctor_prog $(B)/tests/ctor_prog_so $(B)/tests/fp_prog $(B)/tests/misuse_prog
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
	@echo "== bench/memory"; bench/memory

run: all
	sh scripts/run.sh

# A small GPT on the fortunes text over 2 ranks: validation loss vs the unigram baseline, and a sample.
run-gpt: all
	sh scripts/run-gpt.sh

# The .pc is written here, for this PREFIX: installing again elsewhere gives
# that prefix, never the one of an earlier build.
install: all
	install -d $(PREFIX)/lib $(PREFIX)/include/ctrain $(PREFIX)/bin $(PREFIX)/lib/pkgconfig
	install -m 644 $(B)/libctrain.a $(PREFIX)/lib
	install -m 755 $(B)/libctrain.so.$(VERSION) $(PREFIX)/lib
	ln -sf libctrain.so.$(VERSION) $(PREFIX)/lib/libctrain.so.$(SOMAJOR)
	ln -sf libctrain.so.$(SOMAJOR) $(PREFIX)/lib/libctrain.so
	install -m 644 include/ctrain/*.h $(PREFIX)/include/ctrain
	install -m 755 $(B)/ctrain $(PREFIX)/bin
	sed $(PC_SED) -e 's|@PREFIX@|$(abspath $(PREFIX))|' -e 's|@INCLUDEDIR@|$(abspath $(PREFIX))/include|' -e 's|@LIBDIR@|$(abspath $(PREFIX))/lib|' \
	    scripts/ctrain.pc.in > $(PREFIX)/lib/pkgconfig/ctrain.pc

clean:
	rm -rf build build-san build-fuzz

-include $(shell find $(B) -name '*.d' 2>/dev/null)
