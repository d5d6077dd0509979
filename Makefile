# llmexp's set-up and checks. `make test` is the README's second command and what CI runs.
PYTHON ?= python
# The CPU build of torch that lies on disk here; on a GPU machine: make test CONSTRAINTS=
CONSTRAINTS ?= constraints-cpu.txt
PIP_CONSTRAINTS = $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: install cluster deepspeed-ops bytecode test lint bench docs

# pip builds the editable install in a fresh environment of its build backend (~7 s) unless that backend
# (pyproject.toml's build-system.requires) is installed already; then it uses it.
BUILD_DEPS_HERE = $(shell $(PYTHON) -c "import setuptools, wheel; print(int(setuptools.__version__.split('.')[0]) >= 68)" 2>/dev/null)
NO_ISOLATION = $(if $(filter True,$(BUILD_DEPS_HERE)),--no-build-isolation,)

install:
	$(PYTHON) -m pip install -q $(PIP_CONSTRAINTS) $(NO_ISOLATION) -e '.[test,docs]'

cluster:
	bash launch/slurm-local.sh up

# DeepSpeed compiles its CPU ops with g++ on first use (minutes); build them once, into llmexp's cache: the optimizers
# of ZeRO's optimizer offload (Adam, and Lion for optimizer=lion) and the CPU collectives. One make target an op, so
# that `make -j` builds them side by side.
DEEPSPEED_OPS = CPUAdamBuilder CPULionBuilder ShareMemCommBuilder
.PHONY: $(DEEPSPEED_OPS)
deepspeed-ops: $(DEEPSPEED_OPS)
$(DEEPSPEED_OPS):
	TORCH_EXTENSIONS_DIR=$${TORCH_EXTENSIONS_DIR:-$$HOME/.cache/llmexp/torch_extensions} $(PYTHON) -c \
	  "from deepspeed.ops.op_builder import $@; $@().load()"

# Every test, on two workers (pytest-xdist): a test file is one unit of work, except that the SLURM tests are one
# unit together, as they share the one-node cluster; units start longest first (tests/conftest.py). (A third worker,
# tried for the quarter of the CPU that sits idle while the SLURM unit waits on the scheduler, cost more than it
# filled: 2,372 core-seconds against 2,141, 20.3 min against 19.5.) A CPU without native bf16 needs no pass of its
# own: the tests of that path simulate it (LLMEXP_ASSUME_NO_BF16=1, LLMEXP_BF16_EMULATION=1) on every CPU.
# The cluster's packages and daemons come up beside pip's install (each keeps about one core busy: ~15 s saved on a
# fresh machine); the rest needs the installed packages.
test:
	$(MAKE) -j2 install cluster
	$(MAKE) -j2 deepspeed-ops bytecode docs
	$(PYTHON) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

# llmexp's bytecode, compiled once: where PYTHONDONTWRITEBYTECODE is set (this machine and CI set it), every process
# the tests start would compile the ~120 modules it imports again (~0.15 s of CPU a training run, some 500 processes).
bytecode:
	$(PYTHON) -m compileall -q llmexp hydra_plugins

# The documentation site (mkdocs.yml, docs/): a dead link fails the build; it takes seconds.
docs:
	$(PYTHON) -m mkdocs build --strict -d site

lint:
	$(PYTHON) -m ruff check .

bench:
	$(PYTHON) benchmarks/throughput.py
