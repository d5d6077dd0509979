# llmexp's set-up and checks. `make test` is the README's second command and what CI runs.
PYTHON ?= python
# The CPU build of torch that lies on disk here; on a GPU machine: make test CONSTRAINTS=
CONSTRAINTS ?= constraints-cpu.txt
PIP_CONSTRAINTS = $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: install cluster deepspeed-ops test lint bench

install:
	$(PYTHON) -m pip install -q $(PIP_CONSTRAINTS) -e '.[test]'

cluster:
	bash launch/slurm-local.sh up

# DeepSpeed compiles its CPU ops with g++ on first use (minutes); build them once, into llmexp's cache.
deepspeed-ops:
	TORCH_EXTENSIONS_DIR=$${TORCH_EXTENSIONS_DIR:-$$HOME/.cache/llmexp/torch_extensions} $(PYTHON) -c \
	  "from deepspeed.ops.op_builder import CPUAdamBuilder, ShareMemCommBuilder; CPUAdamBuilder().load(); ShareMemCommBuilder().load()"

# Every test, then the quick ones again as a CPU without native bf16 (AMD Zen 3 and older: LLMEXP_ASSUME_NO_BF16=1)
test: install cluster deepspeed-ops
	$(PYTHON) -m pytest
	LLMEXP_ASSUME_NO_BF16=1 $(PYTHON) -m pytest -m "not slow" -q

lint:
	$(PYTHON) -m ruff check .

bench:
	$(PYTHON) benchmarks/throughput.py
