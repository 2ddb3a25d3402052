# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs, profiles, plans, trains a little, writes a report
#   make test   creates .venv, installs (with the Lightning, Accelerate and HF extras), runs ruff, mypy and the tests
#   make check  ruff, mypy and the tests that start no other process (pytest --fast, tests/conftest.py): ~1.5 min
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO_OUT ?= demo-out

.PHONY: venv test check lint demo clean

# scripts/install_venv.sh installs with uv where it can (pip's own configuration passed on; pip otherwise), and
# byte-compiles nothing up front: Python compiles the modules a run imports, once, on first import.  That needs
# Python allowed to write its bytecode: with PYTHONDONTWRITEBYTECODE set (some CI images set it), every process the
# tests start would compile torch's modules again (an `import torch, torchvision` costs 15 s of CPU instead of 6),
# so the targets clear it.
export PYTHONDONTWRITEBYTECODE :=
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --without-pip $(VENV)
	bash scripts/install_venv.sh $(VENV) -e '.[dev,all]'
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

# Two pytest workers (pytest-xdist, the dev extra) where it is installed, one a core: two keep both cores busy (a
# third measured no faster and made the tests that time ranks noisier). A module's tests stay on one worker
# (--dist loadscope), so a module-scoped launch runs once; --no-loadscope-reorder keeps the order tests/conftest.py
# gives the modules (the longest first) rather than xdist's (by test count). Tests marked `alone` read the host's
# CPU load and run afterwards, by themselves. pytest exit 5 (nothing collected, e.g. no `alone` test) is not a
# failure.
PYTEST   = GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 $(PY) -m pytest -q
# A shell substitution, so the recipe's shell evaluates it when the line runs: after `test` has installed the venv.
PARALLEL = $$($(PY) -c "import xdist" >/dev/null 2>&1 && echo "-n 2 --dist loadscope --no-loadscope-reorder")
OK5      = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; rc=0; fi
# The `alone` run collects only the modules that mark a test `alone` (collecting all of them imports every framework
# for a few tests: ~9 s of one core).  None marked: pytest collects everything, selects nothing and exits 5.
ALONE    = $(shell grep -rlE --include='*.py' 'mark\.alone' tests 2>/dev/null | sort)

# The order makes the most of 2 cores, where the suite is CPU-bound:
#  - Chromium (for the report rendering test; Debian's package, installed where missing) installs in the background
#    while the venv installs: the download waits on the network, the install mostly on the disk.
#  - ruff (a second) before any test.  mypy (~20 s of one core from a fresh clone) runs beside the parallel tests at
#    the lowest priority, so it takes the moments a worker leaves a core idle (a launch starting, the run's end)
#    rather than a core of its own before they start; its output follows theirs.  The `alone` tests start after it.
#  - Nothing is imported ahead of the tests to leave bytecode: the first process to import a module compiles it
#    (an import ahead of them measured slower over the whole run than the few modules two processes compile at once).
test:
	@bash scripts/ensure_chromium.sh >/dev/null 2>&1 & chromium=$$!; \
	$(MAKE) --no-print-directory venv || { kill $$chromium 2>/dev/null; exit 1; }; \
	$(PY) -m ruff check . || { kill $$chromium 2>/dev/null; exit 1; }; \
	nice -n 19 $(PY) -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	wait $$chromium || echo "note: chromium unavailable; the report rendering test will be skipped"; \
	$(PYTEST) $(PARALLEL) -m "not alone"; $(OK5); first=$$rc; \
	wait $$mypy; lint=$$?; cat $(VENV)/mypy.log; \
	$(PYTEST) -m alone $(ALONE); $(OK5); \
	if [ $$lint -ne 0 ]; then echo "make test: mypy failed"; exit $$lint; fi; \
	if [ $$first -ne 0 ]; then exit $$first; fi; exit $$rc

# Lint runs beside the fast tests (its output follows theirs): mypy holds one core for ~20 s.
check: venv
	@{ $(PY) -m ruff check . && $(PY) -m mypy; } > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(PYTEST) --fast $(PARALLEL); $(OK5); tests=$$rc; \
	wait $$lint; lint=$$?; cat $(VENV)/lint.log; \
	if [ $$lint -ne 0 ]; then echo "make check: lint failed"; exit $$lint; fi; exit $$tests

demo: venv
	$(VENV)/bin/planner demo --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .mypy_cache .ruff_cache *.egg-info
