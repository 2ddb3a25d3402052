# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs, profiles, plans, trains a little, writes a report
#   make test   creates .venv, installs (with the Lightning, Accelerate and HF extras), runs ruff, mypy and the tests
#   make check  ruff, mypy and the tests that start no other process (pytest --fast, tests/conftest.py): ~1-2 min
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO_OUT ?= demo-out

.PHONY: venv test check lint demo clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,all]'
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

test: lint
	@bash scripts/ensure_chromium.sh >/dev/null 2>&1 || echo "note: chromium unavailable; the report rendering test will be skipped"
	GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 $(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; exit 0; fi; exit $$rc

check: lint
	GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 $(PY) -m pytest -q --fast; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; exit 0; fi; exit $$rc

demo: venv
	$(VENV)/bin/planner demo --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .mypy_cache .ruff_cache *.egg-info
