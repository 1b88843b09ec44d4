# Everything a fresh machine needs: `make serve` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: all install serve test lint llama-server node-deps clean

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Build deps first (no build isolation: the extension build reuses the cached llama.cpp and a
# persistent build dir), then the project in editable mode with its test extras.
install: $(PY)
	$(PIP) install -q "scikit-build-core>=0.10" "pybind11>=2.13"
	$(PY) scripts/llama_cpp.py libs  # visible progress; the extension build below then finds it cached
	$(PIP) install --no-build-isolation -e ".[test]"
	touch $(STAMP)

$(STAMP):
	$(MAKE) install

llama-server: $(STAMP)
	$(PY) scripts/llama_cpp.py server

node-deps:
	cd examples/node && npm install --no-audit --no-fund --silent

serve: $(STAMP)
	$(VENV)/bin/hyspec serve

test: install llama-server node-deps
	$(VENV)/bin/ruff check service tests scripts
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check service tests scripts

clean:
	rm -rf build $(VENV)
