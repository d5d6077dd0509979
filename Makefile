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

# Every test: two workers (pytest-xdist, a test file per worker) for all but the SLURM and DeepSpeed tests, which
# run after them on their own: the SLURM timeout test sizes its run from the machine's measured speed, and the
# one-node cluster and DeepSpeed's CPU Adam want the cores to themselves. A CPU without native bf16 needs no pass of
# its own: the tests of that path simulate it (LLMEXP_ASSUME_NO_BF16=1, LLMEXP_BF16_EMULATION=1) on every CPU.
test: install cluster deepspeed-ops
	$(PYTHON) -m pytest -n 2 --dist loadfile -m "not slurm and not deepspeed"
	$(PYTHON) -m pytest -m "slurm or deepspeed"

lint:
	$(PYTHON) -m ruff check .

bench:
	$(PYTHON) benchmarks/throughput.py
