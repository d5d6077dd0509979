"""llmexp's launchers pass Hydra's own launcher conformance suites (issue 19), as every official launcher
plugin does: `LauncherTestSuite` (sweeps of 1 and 2 jobs, strict mode, bad keys, hydra overrides not
swept, a mandatory default, custom resolvers) and `IntegrationTestSuite` (task names, `get_original_cwd`,
`to_absolute_path`, the sweep's working dir), for `hydra/launcher=llmexp_local` and, on the local
slurmctld, `hydra/launcher=llmexp_slurm`. Hydra's apps here are not llmexp's: no `cluster` node.

The SLURM classes run ~30 one-job arrays; small time limits and a short submitit poll keep them to a
few minutes on two cores.

llmexp's sweepers pass the sweeper suites, as Hydra's own sweeper plugins do: `LauncherTestSuite` (with a
sweeper given, it checks the sweeper's jobs: their overrides, in order, configs and directories) and
`BatchedSweeperTestSuite` (6 jobs in 3 batches of 2, each in its own directory), for
`hydra/sweeper=llmexp_grid` on Hydra's basic launcher (the sweeper plugins' convention: in-process, cheap)
and `hydra/sweeper=llmexp_search` on `llmexp_local` (a search runs its trials through llmexp's launchers),
whose trials then return the task's value. The suites' spaces are lists, which a search runs as a grid,
each point once, in order. One documented difference: a search with nothing to search is refused (exit 2)
where Hydra's sweepers run one job; the three suite tests that sweep nothing assert that instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite
from hydra.test_utils.test_utils import TSweepRunner

from hydra_plugins.llmexp_launcher import llmexp_launcher
from hydra_plugins.llmexp_sweeper import llmexp_sweeper
from tests.conftest import slurm_reachable

QUIET = ["hydra/hydra_logging=disabled", "hydra/job_logging=disabled"]
SLURM = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=30"]


@pytest.fixture(autouse=True)
def _hydra_version_base_unset() -> Iterator[None]:
    """Hydra's suites expect a fresh process's version base (unset: jobs chdir into their output dirs).
    It is a process-wide singleton, and tests/conftest.py's compose() sets it to 1.3 for every test
    after it, so the suites would fail in a full run and pass alone; unset it around each test."""
    from hydra import version

    base = version.VersionBase.instance()
    saved = base.getbase()
    base.version_base = version._UNSPECIFIED_  # no public way to unset it
    yield
    base.version_base = saved


@pytest.fixture(scope="module")
def slurm_up() -> None:
    """The local SLURM cluster (launch/slurm-local.sh), started when sinfo cannot reach one and we are root."""
    assert slurm_reachable(), "no SLURM cluster: run `sudo bash launch/slurm-local.sh up` (make test does)"


@pytest.mark.parametrize("cls", [llmexp_launcher.LocalLauncher, llmexp_launcher.SlurmLauncher])
def test_discovery(cls: type[Launcher]) -> None:
    """Hydra's plugin scan finds both launchers (Hydra accepts launchers only under `hydra_plugins`)."""
    assert cls.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


@pytest.mark.parametrize("name", ["llmexp_local", "llmexp_slurm"])
def test_configs_are_in_the_config_store(name: str) -> None:
    """`hydra/launcher=llmexp_*` resolves in any app: the plugin module registers typed configs."""
    from hydra.core.config_store import ConfigStore

    node = ConfigStore.instance().load(f"hydra/launcher/{name}.yaml").node
    assert node._target_.startswith("hydra_plugins.llmexp_launcher.llmexp_launcher.")


@pytest.mark.parametrize(("launcher_name", "overrides"), [("llmexp_local", ["hydra.launcher.max_parallel=2"])])
class TestLocalLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({}, ["-m", "hydra/launcher=llmexp_local", *QUIET])])
class TestLocalLauncherIntegration(IntegrationTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_up")
@pytest.mark.parametrize(("launcher_name", "overrides"), [("llmexp_slurm", SLURM)])
class TestSlurmLauncher(LauncherTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_up")
@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({}, ["-m", "hydra/launcher=llmexp_slurm", *SLURM, *QUIET])])
class TestSlurmLauncherIntegration(IntegrationTestSuite):
    pass


# ----------------------------------------------------------------------------- the sweepers


@pytest.mark.parametrize("cls", [llmexp_sweeper.GridSweeper, llmexp_sweeper.SearchSweeper])
def test_sweeper_discovery(cls: type[Sweeper]) -> None:
    """Hydra's plugin scan finds both sweepers."""
    assert cls.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]


@pytest.mark.parametrize(("launcher_name", "overrides"), [("basic", ["hydra/sweeper=llmexp_grid"])])
class TestGridSweeper(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"),
                         [("basic", ["hydra/sweeper=llmexp_grid", "hydra.sweeper.max_batch_size=2"])])
class TestGridSweeperWithBatching(BatchedSweeperTestSuite):
    pass


SEARCH = ["hydra/sweeper=llmexp_search", "hydra.sweeper.sampler=random", "hydra.sweeper.parallel=2"]
"""`parallel` is the search's batch: the suite's 2-job sweeps in one launch, as a grid launches them, and
BatchedSweeperTestSuite's 6 points in 3 launches of 2."""


def refused_as_an_empty_search(test: Callable[[], None], capfd: pytest.CaptureFixture[str]) -> None:
    """A suite test whose sweep sweeps nothing: the search exits 2 with its one line, before any trial runs."""
    with pytest.raises(SystemExit) as stop:
        test()
    assert stop.value.code == 2
    err = capfd.readouterr().err
    assert "llmexp: error: a search (sweep=random or sweep=tpe) needs at least one swept key" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("launcher_name", "overrides"), [("llmexp_local", SEARCH)])
class TestSearchSweeper(LauncherTestSuite):
    """Hydra's suite on llmexp_search; the three tests that sweep nothing expect the refusal instead."""

    def test_sweep_1_job(self, hydra_sweep_runner: TSweepRunner, launcher_name: str, overrides: list[str],
                         tmpdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
        refused_as_an_empty_search(
            lambda: super(TestSearchSweeper, self).test_sweep_1_job(hydra_sweep_runner, launcher_name, overrides,
                                                                    tmpdir), capfd)

    def test_sweep_1_job_strict(self, hydra_sweep_runner: TSweepRunner, launcher_name: str, overrides: list[str],
                                tmpdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
        refused_as_an_empty_search(
            lambda: super(TestSearchSweeper, self).test_sweep_1_job_strict(hydra_sweep_runner, launcher_name,
                                                                           overrides, tmpdir), capfd)

    def test_sweep_with_custom_resolver(self, hydra_sweep_runner: TSweepRunner, launcher_name: str,
                                        overrides: list[str], tmpdir: Path,
                                        capfd: pytest.CaptureFixture[str]) -> None:
        refused_as_an_empty_search(
            lambda: super(TestSearchSweeper, self).test_sweep_with_custom_resolver(
                hydra_sweep_runner, launcher_name, overrides, tmpdir), capfd)


@pytest.mark.parametrize(("launcher_name", "overrides"), [("llmexp_local", SEARCH)])
class TestSearchSweeperWithBatching(BatchedSweeperTestSuite):
    pass


OTHER_APP = """
import json, os, signal, time
import hydra
from omegaconf import DictConfig

@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> int:
    if cfg.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.time()
    time.sleep(1.0)
    with open(f"job_{cfg.mode}_{os.getpid()}.json", "w") as f:
        json.dump({"pid": os.getpid(), "start": start, "end": time.time(), "mode": cfg.mode}, f)
    return 0

if __name__ == "__main__":
    main()
"""


def run_other_app(tmp_path: Path, launcher: list[str], modes: str) -> subprocess.CompletedProcess[str]:
    """OTHER_APP's sweep over `+mode=MODES` into `tmp_path/sweep`, with the launcher overrides given."""
    app = tmp_path / "other_app.py"
    app.write_text(OTHER_APP)
    return subprocess.run([sys.executable, str(app), "--multirun", *launcher, "hydra.job.chdir=true",
                           f"+mode={modes}", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)


def test_another_app_runs_each_job_in_its_own_process_without_llmexp_extras(tmp_path: Path) -> None:
    """No `cluster` node: jobs still run side by side in their own processes (max_parallel), but nothing of
    llmexp's is written (no job_status.json, no sweep report), and a killed job fails the sweep as Hydra's would."""
    sweep = tmp_path / "sweep"

    def run(modes: str) -> subprocess.CompletedProcess[str]:
        return run_other_app(tmp_path, ["hydra/launcher=llmexp_local", "hydra.launcher.max_parallel=2"], modes)

    ok = run("a,b")
    assert ok.returncode == 0, ok.stderr
    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/job_*.json"))]
    assert len({r["pid"] for r in records}) == 2 and os.getpid() not in {r["pid"] for r in records}
    assert max(r["start"] for r in records) < min(r["end"] for r in records)  # side by side
    assert not list(sweep.rglob("job_status.json")) and not (sweep / "sweep_summary.json").exists()
    shutil.rmtree(sweep)
    killed = run("a,kill")
    assert killed.returncode == 1 and "killed by SIGKILL" in killed.stderr, killed.stderr


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_up")
def test_another_app_on_slurm_gets_a_failed_return_for_a_job_slurm_saw_die(tmp_path: Path) -> None:
    """A job killed on its node leaves no result: the sweep fails naming the SLURM job, the other job's
    output is there, and nothing of llmexp's is written."""
    proc = run_other_app(tmp_path, ["hydra/launcher=llmexp_slurm", *SLURM], "a,kill")
    assert proc.returncode == 1 and "SLURM job" in proc.stderr, proc.stderr[-3000:]
    assert [json.loads(p.read_text())["mode"] for p in (tmp_path / "sweep").glob("*/job_*.json")] == ["a"]
    assert not list((tmp_path / "sweep").rglob("job_status.json"))
