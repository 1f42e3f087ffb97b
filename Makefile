# The two commands of the README: `make demo` and `make test`. Each creates .venv if needed and installs
# the project with what that target needs; nothing else has to be installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-slow bench bench-sim lint clean

demo: $(VENV)/.installed-envoy
	$(BIN)/inferlb demo

test: $(VENV)/.installed-test
	$(BIN)/pytest

test-slow: $(VENV)/.installed-test
	$(BIN)/pytest -m slow

# What the picker hop costs: Envoy + inferlb against Envoy alone and against a do-nothing ext_proc server.
bench: $(VENV)/.installed-bench
	@command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y -q wrk >/dev/null; }
	$(BIN)/python -m inferlb.bench.hop --out bench/results

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy inferlb filter scorer sim envoy bench

# What the emulator costs (8 servers at 50 req/s) and how fast the simulator replays the Mooncake trace.
bench-sim: $(VENV)/.installed-bench
	$(BIN)/python -m inferlb.bench.sim --out bench/results

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# One stamp per extra; installing again when pyproject.toml changes. xds-protos ships an old copy of
# opentelemetry-proto's modules in the same folder, so whichever pip installs last wins: reinstall the real
# opentelemetry-proto (same version, no dependencies) after every install.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[$*]'
	$(BIN)/pip install -q --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@touch $@

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache *.egg-info
