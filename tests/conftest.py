"""Shared test helpers: tiny-model overrides, the CLI in a subprocess, in-process composition, data files.

Every test uses the real pieces (Hydra, the trainer, the data pipeline); only sizes are shrunk.
One token cache per test session keeps the stdlib tokenizer from being trained more than once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
"""The checkout the tests run: every test file's root for its paths and subprocesses' PYTHONPATH."""

# A model and corpus small enough for a CPU test, still the real Llama model and stdlib corpus.
TINY = [
    "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
    "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=512",
    "model.max_position_embeddings=64", "data.max_length=64", "data.max_examples=60",
    "batch_size=4", "train.eval_batches=2", "train.logging_steps=1",
]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist every worker's runs get one intra-op thread: two workers whose training processes
    each spin two OpenMP threads oversubscribe a 2-core machine, and OpenMP's spin-waiting then burns the
    cores (a test run through the CLI was measured ~20% slower even on an overloaded machine). Tests that
    need their own thread count set it in the environment they pass."""
    # The collector's thresholds of llmexp's own processes (`llmexp.process`): the tests import torch and
    # transformers and train in-process too.
    from llmexp.process import tune_collector

    tune_collector()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # Likewise torch.compile's pool of compile processes (one per core, each importing torch): compiling in the
        # test's own process spends ~15% less CPU on the compile test (56 against 65 CPU-s, 2-core AMD EPYC Zen 5).
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # The tests' torch.compile cache, fresh for this session, before collecting imports transformers (and with it
    # torch._dynamo, which would settle on torch's machine-wide default: `derived.use_shared_compile_cache`).
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        inductor = tempfile.mkdtemp(prefix="llmexp-tests-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
        config.add_cleanup(lambda: shutil.rmtree(inductor, ignore_errors=True))


LONG_FIRST = ("slurm", "tests/test_distributed.py", "tests/test_fsdp.py", "tests/test_resume.py",
              "tests/test_gpu_kit.py", "tests/test_supervision.py", "tests/test_techniques.py",
              "tests/test_search.py", "tests/test_deepspeed.py", "tests/test_mlflow.py", "tests/test_launcher_local.py",
              "tests/test_estimate.py")
"""Units of work handed out first under xdist, the long ones (measured: `pytest --durations=0`), so that no long
unit starts last and ends the run on one worker while the other waits. The two-process units come right after
`slurm`, which mostly waits on the scheduler: their runs fill the core it leaves idle. Only the order depends on
this list."""
TIMEOUT_TEST = "tests/test_slurm.py::test_timeout_checkpoints_requeues_and_resumes_exactly"
"""~3 minutes on SLURM's minute clock with the CPU mostly idle (its jobs are paced, tests/pace/): its sweep is
started ahead (`timeout_sweep`) by the first SLURM test and trains while the other SLURM tests run."""
SLURM_LAST = (TIMEOUT_TEST, "tests/test_slurm.py::test_two_task_jobs_train_as_one_distributed_job")
"""The `slurm` unit's last tests, in this order: the timeout test checks its sweep once the other SLURM tests have
run beside it (each of them one job on the node's other CPU at a time); then the one that needs both CPUs."""


def plain_id(item: pytest.Item) -> str:
    """The test's node id as collected, without the `@group` suffix xdist adds."""
    return item.nodeid.split("@")[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test`'s units of work (`pytest -n 2 --dist loadgroup --no-loadscope-reorder`): a test file is one
    unit, as with `--dist loadfile`, so its module fixtures (shared reference runs) are built once; except that
    every SLURM test is in one unit, `slurm`, as they share the one-node cluster: they run one after the other
    on one worker while the other goes on with the rest."""
    def unit(item: pytest.Item) -> str:
        return "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]

    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(unit(item), len(first_seen))
        item.add_marker(pytest.mark.xdist_group(unit(item)))

    def rank(item: pytest.Item) -> tuple[int, int, int]:
        name, node = unit(item), plain_id(item)
        return (LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST), first_seen[name],
                SLURM_LAST.index(node) + 1 if node in SLURM_LAST else 0)

    items.sort(key=rank)


def slurm_reachable() -> bool:
    """Whether `sinfo` reaches a SLURM cluster; as root, the local one (launch/slurm-local.sh) is started first
    when it does not."""
    def reachable() -> bool:
        return shutil.which("sinfo") is not None and subprocess.run(
            ["sinfo", "-h"], capture_output=True, timeout=30, check=False).returncode == 0
    if not reachable() and os.geteuid() == 0:
        subprocess.run(["bash", str(REPO / "launch" / "slurm-local.sh"), "up"], check=False, timeout=600)
    return reachable()


@pytest.fixture(scope="session")
def timeout_sweep(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The SLURM timeout test's sweep and reference run (tests/test_slurm.py `TimeoutSweep`), started once, by the
    first SLURM test of a session that also runs the timeout test; stopped at the end if still running."""
    from tests.test_slurm import start_timeout_sweep

    if not slurm_reachable():
        pytest.skip("no SLURM cluster: run `sudo bash launch/slurm-local.sh up` (make test does)")
    started = start_timeout_sweep(tmp_path_factory.mktemp("slurm-timeout"))
    yield started
    started.stop()


@pytest.fixture(autouse=True)
def _timeout_sweep_ahead(request: pytest.FixtureRequest) -> None:
    """Every SLURM test starts the timeout test's sweep if this session runs that test, so that it trains beside
    them: the timeout test itself, last but one (SLURM_LAST), then only checks what it did."""
    if request.node.get_closest_marker("slurm") and any(plain_id(i) == TIMEOUT_TEST for i in request.session.items):
        request.getfixturevalue("timeout_sweep")


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One llmexp cache for the whole test session, shared by the xdist workers (unless LLMEXP_CACHE is
    already set, e.g. by CI): the stdlib tokenizer, token arrays, the matmul ceiling and the compile cache are
    built once, not once per worker. The cache's entries appear atomically under a file lock, so workers
    building the same entry at once build it once."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # basetemp/popen-gwN under xdist
    os.environ.setdefault("LLMEXP_CACHE", str(shared / "llmexp-cache"))
    os.environ["LLMEXP_NO_BAR"] = "1"
    os.environ.setdefault("WANDB_MODE", "offline")


def paced_env(pause_s: float) -> dict[str, str]:
    """The environment for processes whose plain engine pauses `pause_s` after each optimizer step
    (tests/pace/sitecustomize.py): a test that must catch a run between two of its steps, or keep it
    training for minutes, gets a window of known length, whatever else the machine runs, for little CPU."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "pace"), str(REPO)]),
            "LLMEXP_TEST_STEP_PAUSE_S": str(pause_s)}


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    """Run as `nobody` (euid 65534) for a moment: tests run as root, which reads a mode-000 file and writes in a
    read-only directory, so this drops that power to meet the kernel's own PermissionError (not root: a no-op)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def run_cli(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
            module: str = "llmexp", timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m llmexp ARGS` as a user would run it, forked from a warm interpreter where it may be
    (tests/warm.py)."""
    from tests import warm

    return warm.run(["-m", module], args, cwd=cwd, env={**os.environ, **(env or {})}, timeout_s=timeout_s)


def compose(overrides: list[str], run_dir: Path) -> Any:
    """The config `python -m llmexp OVERRIDES hydra.run.dir=RUN_DIR` would get, with HydraConfig set,
    so tests can call `llmexp.train.train.train(cfg)` in-process."""
    from llmexp.config.schema import compose_config

    return compose_config(overrides, run_dir)


def tiny_llama(num_attention_heads: int = 4) -> Any:
    """A 2-layer Llama of 64 hidden units and a 512-token vocabulary, seeded: for tests of one model's pieces."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=num_attention_heads, num_key_value_heads=2,
                                        max_position_embeddings=64, attn_implementation="sdpa"))


def read_metrics(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if event is None or r["event"] == event]


def sft_file(path: Path, n: int = 96) -> Path:
    """prompt/completion records of very different lengths: a mean of micro-batch means would differ.

    Also benchmarks/claims.py's data, so its accumulation row measures what the test suite checks.
    """
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    with open(path, "w") as f:
        for i in range(n):
            prompt = " ".join(rng.choices(words, k=rng.randint(2, 20)))
            completion = " ".join(rng.choices(words, k=rng.randint(1, 30)))
            f.write(json.dumps({"prompt": f"Q{i}: {prompt}\n", "completion": completion}) + "\n")
    return path


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 3 MiB filesystem (tmpfs): root can mount one. Elsewhere (CI runs the tests unprivileged)
    the test is skipped; tests/test_checkpoint.py injects ENOSPC there instead."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class Launched(BaseException):
    """A command that `cli_refusal` expected to be refused would have started a run or a sweep (a
    BaseException: Hydra's `run_and_report` turns an Exception into exit 1, which the CLI reports as 2)."""


@pytest.fixture
def cli_refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`python -m llmexp ARGS` in this process, for commands that must be refused before anything starts:
    returns (exit code, stderr). The CLI is the real one (argv check, Hydra's parser and loader, every
    check); only Hydra's run and multirun are replaced, so a command that slips through raises `Launched`
    instead of training. ~0.5 s a call, against ~4 s for a subprocess: the many refusal cases run here, a
    few representative ones through `run_cli`."""
    from hydra._internal.hydra import Hydra

    def launched(*args: Any, **kwargs: Any) -> None:
        raise Launched(f"llmexp {' '.join(sys.argv[1:])} was not refused")

    monkeypatch.setattr(Hydra, "run", launched)
    monkeypatch.setattr(Hydra, "multirun", launched)

    def run(args: list[str]) -> tuple[int, str]:
        from llmexp.cli.main import cli

        monkeypatch.setattr(sys, "argv", ["llmexp", *args])
        capsys.readouterr()
        try:
            cli()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        return code, capsys.readouterr().err

    return run
