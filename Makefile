# Two commands do everything on a fresh machine:
#   make demo   set up .venv and start the Gradio demo (built-in random model unless MODEL=PATH)
#   make test   set up .venv (and Debian's chromium for the browser test) and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?=

.PHONY: install chromium demo test bench

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Browser tests drive Debian's chromium through Playwright (Playwright's own browser download is not used).
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

demo: install
	$(BIN)/python -m app.demo $(if $(MODEL),--model $(MODEL),)

test: install chromium
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python -m bench.lm
	$(BIN)/python -m bench.vision
