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

# Every test (pytest-xdist): a test file is one unit of work, except that the SLURM tests are one unit together,
# as they share the one-node cluster; units start longest first (tests/conftest.py). Three workers for two cores:
# the SLURM unit mostly waits on the scheduler (with two workers a quarter of the CPU sat idle through its ~400 s), so a
# third worker fills that time. A CPU without native bf16 needs no pass of its own: the tests of that path
# simulate it (LLMEXP_ASSUME_NO_BF16=1, LLMEXP_BF16_EMULATION=1) on every CPU.
test: install cluster deepspeed-ops
	$(PYTHON) -m pytest -n 3 --dist loadgroup --no-loadscope-reorder

lint:
	$(PYTHON) -m ruff check .

bench:
	$(PYTHON) benchmarks/throughput.py
