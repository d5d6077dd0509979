"""Multi-process runs through the real launchers (torchrun, accelerate launch; gloo on CPU), and the
DeepSpeed config derived from the composed config.

The end-to-end tests start 2 real processes: 2 x batch_size=4 must give the losses of
1 x batch_size=8 (the sampler shards one global batch), in one run directory written by rank 0,
with checkpoints a 2-process run resumes from exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmexp.errors import UserError
from tests.conftest import TINY, read_metrics, run_cli

RUN = [*TINY, "precision=fp32", "lr=1e-3", "train.max_steps=6", "train.eval_steps=3", "train.save_steps=3",
       "train.peak_tflops=1", "train.warmup_steps=1"]


TASKS = ["eval=demo", "eval.demo_items=9"]
"""A task at every eval: 9 items do not split evenly over 2 ranks."""


def _losses(run_dir: Path, after_resume: bool = False) -> dict[int, float]:
    records = read_metrics(run_dir)
    if after_resume:
        records = records[max(i for i, r in enumerate(records) if r["event"] == "resume"):]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def _launch(launcher: list[str], args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *launcher, "-m", "llmexp", *RUN, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


TORCHRUN = ["torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ACCELERATE = ["accelerate.commands.launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
              "--mixed_precision=no", "--dynamo_backend=no", "--main_process_port=0"]


CPU_ACCELERATE = ["accelerate.commands.launch", "--cpu", "--num_processes=2", "--num_machines=1",
                  "--mixed_precision=no", "--dynamo_backend=no"]


def _first_launcher() -> list[str]:
    """`accelerate launch --cpu --num_processes 2` once the CLI relaunches it as 2 ranks
    (`relaunch.maybe_relaunch`, called first in `llmexp.__main__.cli`), else torchrun."""
    import llmexp.__main__ as entry

    return CPU_ACCELERATE if "maybe_relaunch" in Path(entry.__file__).read_text() else TORCHRUN


@pytest.mark.slow
def test_two_processes_match_one_and_resume(tmp_path: Path) -> None:
    single = tmp_path / "single"
    result = run_cli([*RUN, *TASKS, "batch_size=8", f"hydra.run.dir={single}"])
    assert result.returncode == 0, result.stderr[-3000:]

    # No hydra.run.dir: both ranks must agree on one outputs/<date>/<time>-<launcher pid>.
    result = _launch(_first_launcher(), [*TASKS, "batch_size=4"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = [p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.jsonl")]
    assert len(run_dirs) == 1, run_dirs
    multi = run_dirs[0]
    one, two = _losses(single), _losses(multi)
    assert one.keys() == two.keys() == set(range(1, 7))  # rank 0 only: each step logged once
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    summary = (multi / "summary.json").read_text()
    assert '"world_size": 2' in summary and '"peak_mem_mb"' in summary
    ckpt = multi / "checkpoints" / "step_3"
    assert (ckpt / "rng_rank0.pt").is_file() and (ckpt / "rng_rank1.pt").is_file()
    # eval tasks: each rank scores its share (9 items: 5 and 4, in lockstep), rank 0 logs the sums
    tasks = lambda d: [(r["step"], r["items"], r["metrics"]) for r in read_metrics(d, "eval_task")]  # noqa: E731
    assert [t[:2] for t in tasks(multi)] == [(0, 9), (3, 9), (6, 9)]
    for (_, _, m1), (_, _, m2) in zip(tasks(single), tasks(multi), strict=True):
        assert m2 == pytest.approx(m1), (m1, m2)

    # Resume the 2-process run with accelerate launch: from step_3, steps 4-6 again, exactly.
    shutil.rmtree(multi / "checkpoints" / "step_6")
    result = _launch(ACCELERATE, [*TASKS, "batch_size=4", f"hydra.run.dir={multi}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = _losses(multi, after_resume=True)
    assert resumed.keys() == {4, 5, 6}
    for step in resumed:
        assert resumed[step] == pytest.approx(two[step], rel=1e-6), step


def test_bad_deepspeed_combinations_exit_2_before_anything_is_written(tmp_path: Path) -> None:
    """Refused by the CLI's checks, before Hydra makes the run directory (they were refused inside the run,
    which left `outputs/<date>/<time>/` with `.hydra/`, a lock and an empty log behind) and before torch loads."""
    result = run_cli([*TINY, "deepspeed=zero2_offload", "optimizer=sgd", "train.max_steps=2"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "optimizer: sgd has no DeepSpeed CPU implementation" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "outputs").exists()
    result = run_cli([*TINY, "deepspeed=zero2_offload", "optimizer=adamw8bit", "train.max_steps=2"], cwd=tmp_path)
    assert result.returncode == 2 and "offload" in result.stderr and not (tmp_path / "outputs").exists()


def _cfg(*overrides: str):
    from llmexp.cli.estimate import compose

    return compose(list(overrides))


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["deepspeed=zero2", "deepspeed.offload_param=cpu"], "needs ZeRO stage 3"),
    (["deepspeed=zero2_offload", "optimizer=sgd"], "no DeepSpeed CPU implementation"),
    (["deepspeed=zero2_offload", "optimizer=lion"], None),
    (["deepspeed=zero2", "train.compile=true"], None),  # blocks compiled before the engine wraps the model
    (["deepspeed=none", "train.compile=true"], None),
    (["deepspeed=zero2", "precision=fp16", "precision.init_scale=1000"], "power"),
    pytest.param(["deepspeed=zero2", "precision=fp16"], "no fp16", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the CPU accelerator's limit")),
])
def test_deepspeed_combinations_name_the_conflict(overrides: list[str], fragment: str | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`validate` and the machine's check (`check_environment`), which the CLI runs before anything is written."""
    from llmexp.config.validation import validate
    from llmexp.machine.environment import check_environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU is visible: fp16 has no DeepSpeed CPU kernel

    def check() -> None:
        cfg = _cfg(*overrides)  # (composed and validated, as llmexp.estimate does)
        validate(cfg)
        check_environment(cfg)

    if fragment is None:
        check()
        return
    with pytest.raises(UserError, match=fragment):
        check()


def test_fp16_under_deepspeed_needs_a_gpu_that_torch_can_use() -> None:
    """Before anything loads the check guesses from the device files (`gpu_visible`); as the run starts torch
    answers (a CPU build of torch on a GPU machine passes the guess): the same rule, the machine's two answers."""
    from llmexp.machine.environment import deepspeed_errors

    cfg = _cfg("deepspeed=zero2", "precision=fp16")
    assert "DeepSpeed's CPU accelerator has no fp16" in deepspeed_errors(cfg, cuda=False)[0]
    assert deepspeed_errors(cfg, cuda=True) == []
    assert deepspeed_errors(_cfg("deepspeed=zero2", "precision=fp32"), cuda=False) == []


def test_deepspeed_config_agrees_with_the_loop() -> None:
    from llmexp.config.derived import make_plan
    from llmexp.train.distributed import deepspeed_config

    cfg = _cfg("deepspeed=zero2_offload", "batch_size=2", "train.global_batch_size=16", "train.max_grad_norm=0.5",
               "precision=bf16")
    plan = make_plan(cfg, 4)
    ds = deepspeed_config(cfg, micro=plan.micro, accum=plan.accum, world=plan.world, precision="bf16", cuda=True)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 2)
    assert ds["train_batch_size"] == 16 == plan.global_batch
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["bf16"]["check_grad_overflow"]
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "auto" not in repr(ds)

    cfg = _cfg("deepspeed=zero3", "precision=fp16", "precision.init_scale=1024", "precision.growth_interval=100")
    ds = deepspeed_config(cfg, micro=8, accum=1, world=2, precision="fp16", cuda=True)
    assert ds["fp16"]["enabled"] and ds["fp16"]["initial_scale_power"] == 10
    assert ds["fp16"]["loss_scale_window"] == 100 and ds["fp16"]["loss_scale"] == 0  # dynamic, like GradScaler
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_relaunch_turns_accelerate_cpu_multiprocess_into_torchrun() -> None:
    from llmexp.cli.relaunch import relaunch_argv

    parent = ["/usr/bin/python", "/usr/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "-m", "llmexp"]
    env = {"ACCELERATE_USE_CPU": "True"}
    argv = relaunch_argv(parent, env, ["-m", "llmexp", "lr=1e-3"])
    assert argv is not None and "--nproc_per_node=2" in argv and argv[-3:] == ["-m", "llmexp", "lr=1e-3"]
    as_module = ["python", "-m", "accelerate.commands.launch", "--cpu", "--num_processes=3", "-m", "llmexp"]
    assert "--nproc_per_node=3" in (relaunch_argv(as_module, env, ["-m", "llmexp"]) or [])
    assert relaunch_argv(parent, {**env, "WORLD_SIZE": "2"}, ["-m", "llmexp"]) is None  # already a rank
    one = ["accelerate", "launch", "--cpu", "--num_processes=1", "-m", "llmexp"]
    assert relaunch_argv(one, env, ["-m", "llmexp"]) is None
    script_flag = ["accelerate", "launch", "--cpu", "train.py", "--num_processes", "4"]  # the script's own flag
    assert relaunch_argv(script_flag, env, ["-m", "llmexp"]) is None


def test_run_id_is_shared_by_the_ranks_of_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmexp.rundir import names

    monkeypatch.delenv("LLMEXP_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    rank_id = names.run_id()
    assert rank_id.endswith(f"-{os.getppid()}")  # the launcher's pid, the same for every local rank
    assert names.run_id() == rank_id
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes, one rank each: no common parent process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "exp7")
    assert names.run_id() == "torchrun-exp7"  # torchrun --rdzv_id=exp7 on every node
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert names.run_id() == "slurm-4242"


@pytest.mark.parametrize(("name", "processes"), [("1gpu", 1), ("8gpu", 8), ("deepspeed_zero2_offload", 8)])
def test_launch_configs_load_with_accelerate(name: str, processes: int) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    from llmexp.config.tree import conf_dir

    config = load_config_from_file(str(conf_dir().parents[1] / "launch" / "accelerate" / f"{name}.yaml"))
    assert config.num_processes == processes and config.mixed_precision == "no"  # llmexp owns precision


def test_deepspeed_launch_config_must_match_the_deepspeed_group() -> None:
    from llmexp.train.distributed import check_launch_env

    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"}
    check_launch_env(_cfg("deepspeed=zero2_offload"), env)  # agrees: fine
    with pytest.raises(UserError, match=r"deepspeed\.stage=0"):
        check_launch_env(_cfg(), env)
    with pytest.raises(UserError, match="offload_optimizer: launcher cpu"):
        check_launch_env(_cfg("deepspeed=zero2"), env)
    check_launch_env(_cfg("deepspeed=zero2"), {})  # no DeepSpeed launcher: nothing to agree with


@pytest.mark.slow
def test_two_processes_with_lora_match_one(tmp_path: Path) -> None:
    """DDP with adapters: only the adapters' gradients are all-reduced (the frozen base has none), and
    2 x batch_size=4 gives the losses of 1 x batch_size=8, with non-reentrant gradient checkpointing on in
    the 2-process run. Adapter dropout is off: its masks are drawn per rank."""
    lora = ["peft=lora", "peft.r=4", "peft.lora_dropout=0.0", "train.max_steps=3", "train.save_steps=3"]
    single = tmp_path / "single"
    result = run_cli([*RUN, *lora, "batch_size=8", f"hydra.run.dir={single}"])
    assert result.returncode == 0, result.stderr[-3000:]
    multi = tmp_path / "multi"
    result = _launch(TORCHRUN, [*lora, "model.gradient_checkpointing=true", "batch_size=4",
                                f"hydra.run.dir={multi}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = _losses(single), _losses(multi)
    assert one.keys() == two.keys() == {1, 2, 3}
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
    assert (multi / "model" / "adapter_model.safetensors").is_file()


def _training(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"event": "train"' in metrics.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["accelerate launch", "torchrun"])
def test_workers_end_when_their_launcher_is_killed(victim: str, tmp_path: Path) -> None:
    """kill -9 of the launcher a user started (`accelerate launch --cpu`, which llmexp turns into torchrun), or
    of torchrun itself: the workers, each in a session of its own, stop within seconds instead of training on as
    orphans holding the run directory's lock."""
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    args = [*RUN, "train.max_steps=100000", "train.save_steps=0", "train.eval_steps=100000", "batch_size=4",
            f"hydra.run.dir={run_dir}"]
    with open(tmp_path / "launch.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, "-m", *CPU_ACCELERATE, "-m", "llmexp", *args], cwd=tmp_path,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not _training(run_dir):
            assert launcher.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        tree = psutil.Process(launcher.pid).children(recursive=True)  # torchrun (the relaunch) and its 2 workers
        assert len(tree) == 3, tree
        torchrun = psutil.Process(launcher.pid).children()[0]
        os.kill(launcher.pid if victim == "accelerate launch" else torchrun.pid, signal.SIGKILL)
        launcher.wait()
        _, alive = psutil.wait_procs(tree, timeout=150)
        assert not alive, f"still running after their launcher died: {alive}"
    finally:
        for proc in [*tree, psutil.Process(launcher.pid) if launcher.poll() is None else None]:
            if proc is not None and proc.is_running():
                proc.kill()  # only the processes this test started
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted", summary  # stopped as on SIGTERM: a checkpoint, then the summary
    assert any((run_dir / "checkpoints").glob("step_*"))
