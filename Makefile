# Two entry points for a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench lint mutation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[embedded,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ipdp demo

# npm ci installs playwright-core, the browser test's driver; it drives Debian's chromium and must
# never download a browser of its own, which the variable guarantees.
test: $(STAMP)
	bash scripts/install-test-deps.sh
	cd producer/web && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund && npm test
	$(MAKE) lint
	$(BIN)/python -m pytest -n 3

bench: $(STAMP)
	$(BIN)/ipdp bench throughput

# Not part of `make test`: mutates the modules a guarantee rests on and runs their fast tests
# against each mutant (docs/testing.md); one worker at low priority.
mutation: $(STAMP)
	nice -n 15 $(BIN)/python scripts/mutation.py

lint: $(STAMP)
	$(BIN)/ruff check ipdp producer aggregator trainer gateway helper tests bench

clean:
	rm -rf $(VENV) .pytest_cache mutants
