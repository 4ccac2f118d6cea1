# Two commands do everything on a fresh machine:
#   make demo   set up .venv, build the CPU kernels, start the Gradio demo (built-in random model unless MODEL=PATH)
#   make test   set up .venv, build the CPU kernels (and install Debian's chromium for the browser test), run the tests
# make test-fast runs the fast tier: no test marked slow, subprocess or browser (pyproject.toml's markers).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?=

.PHONY: install kernels chromium demo test test-fast bench

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The C++ CPU kernels (lm/kernels), built once per CPU instruction set and source version (a few
# minutes, announced), then loaded from the cache in a second. Fails loudly without a C++ compiler;
# QWEN35_CPU_KERNELS=0 skips them (the reference PyTorch paths, 2-3x slower on CPU).
kernels: install
	$(BIN)/python -m lm.kernels.build

# Browser tests drive Debian's chromium through Playwright (Playwright's own browser download is not used).
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

demo: kernels
	$(BIN)/python -m app.demo $(if $(MODEL),--model "$(MODEL)",)

test: kernels chromium
	$(BIN)/python -m pytest

test-fast: kernels
	$(BIN)/python -m pytest -m "not slow and not subprocess and not browser"

bench: kernels
	$(BIN)/python -m bench.lm
	$(BIN)/python -m bench.vision
