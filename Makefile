# Two commands a newcomer needs: `make run` and `make test`. Each builds .venv from nothing
# the first time (torch 2.13.0 from the CPU wheel on this machine's disk: pinned in
# constraints.txt, while pyproject.toml names the range users may have), and installs nothing on
# later calls unless pyproject.toml or constraints.txt changed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.intqat-installed

.PHONY: run test test-slow bench clean

CONSTRAINTS := constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/intqat-train

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/intqat-bench all

clean:
	rm -rf $(VENV) build *.egg-info outputs
