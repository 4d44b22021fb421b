# kvtools build.  `make` builds every tool into bin/; with nvcc found it also
# builds kernels/ for sm_90 (+ PTX) and links them (CUDA=0 forces CPU-only).
# `make check` runs unit tests (plain and ASan+UBSan), bats tests (against the
# tools, then against ASan+UBSan builds of them) and the fuzzers, every
# sanitizer report fatal; `make demo` runs the toolkit on the bundled real model.
# Sources are globbed: lib/*/*.c -> libkv, cmd/cli/*.c -> the front end,
# cmd/kv-*.c -> tools (kv-bench, kv-run and kv-tree with cmd/bench, cmd/run, cmd/tree),
# tests/unit/test_*.c -> unit tests, tests/fuzz/fuzz_*.c -> fuzzers.

PREFIX ?= /usr/local
DESTDIR ?=
CC ?= cc
CLANG ?= clang
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(shell command -v nvcc 2>/dev/null || { test -x $(CUDA_HOME)/bin/nvcc && echo $(CUDA_HOME)/bin/nvcc; })
FUZZ_SECONDS ?= 30
# Separate trees let several builds run side by side: make B=build-x BINDIR=bin-x
B ?= build
BINDIR ?= bin

ifeq ($(origin CUDA),undefined)
  CUDA := $(if $(NVCC),1,0)
endif

WARN := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
ifneq ($(CI),)
  WARN += -Werror
endif
ifneq ($(WERROR),)
  WARN += -Werror
endif

OPT ?= -O2 -march=x86-64-v2
BASE_CFLAGS := -std=c11 -D_GNU_SOURCE -g $(WARN) -Ilib -Ikernels -Icmd/cli -fopenmp
CFLAGS_ALL := $(BASE_CFLAGS) $(OPT) $(CFLAGS)
LIBS := -lzstd -lcjson -lm -lpthread -fopenmp

LIB_SRC := $(sort $(wildcard lib/*/*.c))
CLI_SRC := $(sort $(wildcard cmd/cli/*.c))
CMD_SRC := $(sort $(wildcard cmd/kv-*.c))
CU_SRC := $(sort $(wildcard kernels/*.cu))
UNIT_SRC := $(sort $(wildcard tests/unit/test_*.c))
UNIT_HDRS := $(wildcard tests/unit/*.h)
FUZZ_SRC := $(sort $(wildcard tests/fuzz/fuzz_*.c))
TOOLS := $(patsubst cmd/%.c,$(BINDIR)/%,$(CMD_SRC))
HDRS := $(wildcard lib/*/*.h kernels/*.h kernels/*.cuh cmd/cli/*.h)

ifeq ($(CUDA),1)
  CFLAGS_ALL += -DKV_HAVE_CUDA -I$(CUDA_HOME)/include
  NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC -lineinfo
  NVCC_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_75,code=compute_75
  CU_OBJ := $(patsubst kernels/%.cu,$(B)/cuda/%.o,$(CU_SRC))
  LIBS += -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
  BUILD_KIND := CUDA ($(NVCC))
else
  CU_OBJ :=
  BUILD_KIND := CPU-only
endif

LIB_OBJ := $(patsubst lib/%.c,$(B)/obj/%.o,$(LIB_SRC))
CLI_OBJ := $(patsubst cmd/cli/%.c,$(B)/cli/%.o,$(CLI_SRC))

.PHONY: FORCE all check demo install clean deps fuzz unit unit-asan bats bench print-build asan-tools
all: print-build $(TOOLS) unit-bins

print-build:
	@echo "kvtools: building $(BUILD_KIND)"

# Objects depend on the flags they were built with (CUDA=0/1, OPT, ...).
$(B)/flags.stamp: FORCE
	@mkdir -p $(@D)
	@echo '$(CC) $(CFLAGS_ALL) $(NVCC) $(NVCC_ARCH)' > $@.new; \
	if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
FORCE:

$(B)/obj/%.o: lib/%.c $(HDRS) $(B)/flags.stamp
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -c -o $@ $<

$(B)/cuda/%.o: kernels/%.cu $(HDRS) $(B)/flags.stamp
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) $(NVCC_ARCH) -Ilib -Ikernels -DKV_HAVE_CUDA -c -o $@ $<

# kernels/*_sm90a.cu use Hopper-only instructions (wgmma): built for sm_90a
# alone; their launchers check the device before using them.
$(B)/cuda/%_sm90a.o: kernels/%_sm90a.cu $(HDRS) $(B)/flags.stamp
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -gencode arch=compute_90a,code=sm_90a -Ilib -Ikernels -DKV_HAVE_CUDA -c -o $@ $<

$(B)/cli/%.o: cmd/cli/%.c $(HDRS) $(B)/flags.stamp
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -c -o $@ $<

$(B)/libkv.a: $(LIB_OBJ) $(CU_OBJ)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

$(B)/libkvcli.a: $(CLI_OBJ)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

$(BINDIR)/%: cmd/%.c $(B)/libkvcli.a $(B)/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(B)/libkvcli.a $(B)/libkv.a $(LIBS)

# kv-bench links its subcommands from cmd/bench/ (each parses its own options);
# kv-run links cmd/run/ (its options, the --kv/--store reuse flow) and kv-tree
# cmd/tree/ (its subcommands' pieces).
BENCH_SRC := $(sort $(wildcard cmd/bench/*.c))
BENCH_HDRS := $(wildcard cmd/bench/*.h)
RUN_SRC := $(sort $(wildcard cmd/run/*.c))
RUN_HDRS := $(wildcard cmd/run/*.h)
TREE_SRC := $(sort $(wildcard cmd/tree/*.c))
TREE_HDRS := $(wildcard cmd/tree/*.h)
$(BINDIR)/kv-bench: cmd/kv-bench.c $(BENCH_SRC) $(BENCH_HDRS) $(B)/libkvcli.a $(B)/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Icmd/bench -o $@ cmd/kv-bench.c $(BENCH_SRC) $(B)/libkvcli.a $(B)/libkv.a $(LIBS)
$(BINDIR)/kv-run: cmd/kv-run.c $(RUN_SRC) $(RUN_HDRS) $(B)/libkvcli.a $(B)/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Icmd/run -o $@ cmd/kv-run.c $(RUN_SRC) $(B)/libkvcli.a $(B)/libkv.a $(LIBS)
$(BINDIR)/kv-tree: cmd/kv-tree.c $(TREE_SRC) $(TREE_HDRS) $(B)/libkvcli.a $(B)/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Icmd/tree -o $@ cmd/kv-tree.c $(TREE_SRC) $(B)/libkvcli.a $(B)/libkv.a $(LIBS)

# ---- unit tests --------------------------------------------------------
UNIT_BINS := $(patsubst tests/unit/%.c,$(B)/unit/%,$(UNIT_SRC))
unit-bins: $(UNIT_BINS)
$(B)/unit/%: tests/unit/%.c $(B)/libkvcli.a $(B)/libkv.a $(HDRS) $(UNIT_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_ALL) -Itests/unit -o $@ $< $(B)/libkvcli.a $(B)/libkv.a $(LIBS)

# Sanitizer build: CPU-only library, unit tests and tools under ASan + UBSan
# (float-cast-overflow too: GCC's -fsanitize=undefined leaves it out), every
# report fatal.  The tools in $(B)/asan/bin run part of the bats suite in
# make check (tests/run-tests.sh).
SAN := -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all
ASAN_FLAGS := $(BASE_CFLAGS) -O1 -fno-omit-frame-pointer $(SAN)
ASAN_LIB_OBJ := $(patsubst lib/%.c,$(B)/asan/obj/%.o,$(LIB_SRC))
ASAN_BINS := $(patsubst tests/unit/%.c,$(B)/asan/unit/%,$(UNIT_SRC))
ASAN_TOOLS := $(patsubst cmd/%.c,$(B)/asan/bin/%,$(CMD_SRC))
ASAN_LIBS := -lzstd -lcjson -lm -lpthread $(SAN)
$(B)/asan/flags.stamp: FORCE
	@mkdir -p $(@D)
	@echo '$(CC) $(ASAN_FLAGS)' > $@.new; \
	if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
$(B)/asan/obj/%.o: lib/%.c $(HDRS) $(B)/asan/flags.stamp
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -c -o $@ $<
$(B)/asan/cli/%.o: cmd/cli/%.c $(HDRS) $(B)/asan/flags.stamp
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -c -o $@ $<
$(B)/asan/libkv.a: $(ASAN_LIB_OBJ) $(patsubst cmd/cli/%.c,$(B)/asan/cli/%.o,$(CLI_SRC))
	rm -f $@ && ar rcs $@ $^
$(B)/asan/unit/%: tests/unit/%.c $(B)/asan/libkv.a $(HDRS) $(UNIT_HDRS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -Itests/unit -o $@ $< $(B)/asan/libkv.a $(ASAN_LIBS)
$(B)/asan/bin/%: cmd/%.c $(B)/asan/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -o $@ $< $(B)/asan/libkv.a $(ASAN_LIBS)
$(B)/asan/bin/kv-bench: cmd/kv-bench.c $(BENCH_SRC) $(BENCH_HDRS) $(B)/asan/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -Icmd/bench -o $@ cmd/kv-bench.c $(BENCH_SRC) $(B)/asan/libkv.a $(ASAN_LIBS)
$(B)/asan/bin/kv-run: cmd/kv-run.c $(RUN_SRC) $(RUN_HDRS) $(B)/asan/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -Icmd/run -o $@ cmd/kv-run.c $(RUN_SRC) $(B)/asan/libkv.a $(ASAN_LIBS)
$(B)/asan/bin/kv-tree: cmd/kv-tree.c $(TREE_SRC) $(TREE_HDRS) $(B)/asan/libkv.a $(HDRS)
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -Icmd/tree -o $@ cmd/kv-tree.c $(TREE_SRC) $(B)/asan/libkv.a $(ASAN_LIBS)
asan-tools: $(ASAN_TOOLS)

# ---- fuzzers (clang libFuzzer) ------------------------------------------
# The library is compiled once with coverage and sanitizers, then each
# fuzz target links against it.  Every sanitizer report aborts the run
# (without -fno-sanitize-recover a UBSan finding was printed and fuzzing
# went on, so make check could not fail on it).
FUZZ_SAN := -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all
FUZZ_FLAGS := -std=c11 -D_GNU_SOURCE -g -O1 -Ilib -Icmd/cli -fsanitize=fuzzer-no-link $(FUZZ_SAN)
FUZZ_BINS := $(patsubst tests/fuzz/%.c,$(B)/fuzz/%,$(FUZZ_SRC))
FUZZ_OBJ := $(patsubst %.c,$(B)/fuzzobj/%.o,$(LIB_SRC) $(CLI_SRC))
$(B)/fuzzobj/flags.stamp: FORCE
	@mkdir -p $(@D)
	@echo '$(CLANG) $(FUZZ_FLAGS)' > $@.new; \
	if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
$(B)/fuzzobj/%.o: %.c $(HDRS) $(B)/fuzzobj/flags.stamp
	@mkdir -p $(@D)
	$(CLANG) $(FUZZ_FLAGS) -c -o $@ $<
$(B)/fuzzobj/libkvfuzz.a: $(FUZZ_OBJ)
	rm -f $@ && ar rcs $@ $^
$(B)/fuzz/%: tests/fuzz/%.c $(B)/fuzzobj/libkvfuzz.a $(HDRS)
	@mkdir -p $(@D)
	$(CLANG) $(FUZZ_FLAGS) -fsanitize=fuzzer -o $@ $< $(B)/fuzzobj/libkvfuzz.a -lzstd -lcjson -lm -lpthread
fuzz: $(FUZZ_BINS) $(B)/fuzz/canary_ub $(B)/asan/canary_ub
# the canary (tests/fuzz/canary_ub.c) under both sets of sanitizer flags: make
# check expects each to die of a planted report
$(B)/fuzz/canary_ub: tests/fuzz/canary_ub.c $(B)/fuzzobj/flags.stamp
	@mkdir -p $(@D)
	$(CLANG) $(FUZZ_FLAGS) -fsanitize=fuzzer -o $@ $<
$(B)/asan/canary_ub: tests/fuzz/canary_ub.c $(B)/asan/flags.stamp
	@mkdir -p $(@D)
	$(CC) $(ASAN_FLAGS) -DCANARY_MAIN -o $@ $< $(ASAN_LIBS)

# ---- top-level targets --------------------------------------------------
deps:
	@sh tests/deps.sh

check: deps
	@$(MAKE) --no-print-directory all
	@$(MAKE) --no-print-directory CUDA=0 $(ASAN_BINS) $(ASAN_TOOLS)
	@$(MAKE) --no-print-directory fuzz
	@FUZZ_SECONDS=$(FUZZ_SECONDS) KV_BUILD=$(B) KV_BIN=$(CURDIR)/$(BINDIR) sh tests/run-tests.sh

demo: deps
	@$(MAKE) --no-print-directory all
	@KV_BIN=$(CURDIR)/$(BINDIR) sh tests/demo.sh

bench: all
	@echo "see docs/BENCHMARKS.md for the benchmark commands"

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/man/man5
	install -m 755 $(TOOLS) $(DESTDIR)$(PREFIX)/bin/
	install -m 644 $(wildcard man/*.1) $(DESTDIR)$(PREFIX)/share/man/man1/
	install -m 644 $(wildcard man/*.5) $(DESTDIR)$(PREFIX)/share/man/man5/

clean:
	rm -rf $(B) $(BINDIR)
