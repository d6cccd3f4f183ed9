# Two commands set everything up on a fresh machine:
#   make demo   create .venv, install hetero, train Wide & Deep on MovieLens-100K
#   make test   run the whole test suite in the same venv
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
# Test processes (pytest-xdist). In one process the suite kept 0.6 of CI's 2 cores busy (17 min
# of CPU in 28 of wall: its tests wait on processes starting, ranks meeting, files synced); in two,
# 19.5 and 24 min of wall in two runs on the same host (2026-12-02). Each file's tests stay in one process
# (--dist loadfile: a module's fixtures are built once).
TEST_WORKERS ?= 2
# TorchRec for hetero.torchrec and its tests, without its declared dependencies (they name the CUDA
# FBGEMM wheel, which pulls another torch): the extra hetero[torchrec] pins the CPU ones.
TORCHREC := torchrec==1.8.0

.PHONY: demo test bench install clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-installs only when the dependency lists change (idempotent).
$(STAMP): pyproject.toml requirements-dev.txt Makefile | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[torchrec]"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(TORCHREC)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hetero train --config examples/movielens.toml --run-dir runs/demo --overwrite $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

bench: $(STAMP)
	$(PY) benchmarks/embedding_step.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/host_adam.py
	$(PY) benchmarks/ps.py
	$(PY) benchmarks/data_pipeline.py
	$(PY) benchmarks/pp_memory.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info .pytest_cache
