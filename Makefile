# Everyday commands. They use the project's virtual environment (.venv) when it exists;
# create it with the README's install command:  python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]"
VENV ?= .venv
BIN  := $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/,)
PY   := $(if $(BIN),$(BIN)python,python3)

.PHONY: help test export clean-nbs docs readme check clean

help:
	@echo "make test       run every notebook's tests (nbdev_test; skips #| slow and #| gpu cells), then pytest tests"
	@echo "make export     regenerate compressive_tutorial/ from the notebooks (nbdev_export)"
	@echo "make clean-nbs  strip notebook metadata noise (nbdev_clean)"
	@echo "make docs       export, then build the docs site into docs/ and README.md from the notebooks (offline)"
	@echo "make readme     regenerate README.md from nbs/index.ipynb only"
	@echo "make check      everything CI checks (bash .ci/run)"
	@echo "make clean      remove build intermediates (_proc/)"

test:
	$(BIN)nbdev_test --timing
	$(PY) -m pytest -q tests

export:
	$(BIN)nbdev_export

clean-nbs:
	$(BIN)nbdev_clean

docs: export
	$(PY) .ci/build_docs.py

readme:
	$(PY) .ci/build_docs.py --readme-only

check:
	bash .ci/run

clean:
	rm -rf _proc
