"""Run and sweep reports and the doctor, on hand-made run directories (the files a run leaves behind)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from llmexp.report import doctor
from llmexp.report.__main__ import main as report_main
from llmexp.report.run import write_run_report
from llmexp.report.sweep import stability, varying_params, write_sweep_report
from tests.conftest import run_cli
from tests.test_monitor import healthy_loss, history

CONFIG = {"lr": 3e-4, "batch_size": 8, "seed": 0, "model": {"name": "tiny", "name_or_path": None, "hidden_size": 64},
          "train": {"max_grad_norm": 1.0, "gradient_accumulation_steps": 2, "max_steps": 1000, "on_anomaly": "skip"},
          "precision": {"name": "bf16"}, "optimizer": {"name": "adamw"}, "scheduler": {"name": "cosine"}}


def make_run(run_dir: Path, records: list[dict], summary: dict | None = None, overrides: tuple[str, ...] = (),
             job_status: dict | None = None, torn_tail: bool = False) -> Path:
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(lines + ('{"event": "train", "st' if torn_tail else ""))
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    lr = next((float(o.split("=")[1]) for o in overrides if o.startswith("lr=")), CONFIG["lr"])
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "lr": lr}))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if job_status is not None:
        (run_dir / "job_status.json").write_text(json.dumps(job_status))
    return run_dir


def summary_of(records: list[dict], status: str = "completed") -> dict:
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    return {"status": status, "step": train[-1]["step"], "train_loss": train[-1]["loss"],
            "eval_loss": evals[-1]["eval_loss"], "eval_ppl": evals[-1]["eval_ppl"], "tokens_per_sec": 1234.0,
            "mfu": 0.1, "lr": 3e-4, "lr_source": "config", "exit_code": 0, "findings": []}


def png_size(path: Path) -> tuple[int, int]:
    import matplotlib.image

    image = matplotlib.image.imread(path)
    return image.shape[1], image.shape[0]


def broken_history() -> list[dict]:
    """Overfitting from step 400, a loss spike at 510, a NaN at 610."""
    records = history(num_steps=1000, eval_loss=lambda s: healthy_loss(min(s, 400)) + 0.3 + 0.004 * max(s - 400, 0))
    train = [r for r in records if r["event"] == "train"]
    train[50]["loss"] *= 3
    train[60]["loss"] = train[60]["grad_norm"] = float("nan")
    return records


def test_run_report_has_status_metrics_findings_settings_and_curves(tmp_path: Path) -> None:
    records = broken_history()
    run = make_run(tmp_path / "run", records, summary_of(records), ("lr=3e-4", "train.max_steps=1000"))
    write_run_report(run)
    text = (run / "report.md").read_text()
    assert "**Status:** completed" in text and "`lr=3e-4 train.max_steps=1000`" in text
    assert "| best eval loss | " in text and "(step 400)" in text and "| tokens/s | 1,234 |" in text
    for kind, step in (("overfitting", 400), ("loss_spike", 510), ("non_finite", 610)):
        assert f"`{kind}` at step {step}" in text
    assert "*advice:*" in text and "dropout" in text
    assert "| gradient accumulation | 2 |" in text and "| precision | bf16 |" in text and "| lr | 3e-04 |" in text
    width, height = png_size(run / "curves.png")
    assert width > 1000 and height > 600
    assert not list(run.glob(".*.tmp")) and not list(run.glob(".curves*"))  # no temp files left behind


def test_the_settings_of_a_fine_tune_name_its_model_not_the_unused_fields() -> None:
    """A run of model.name_or_path=DIR listed the model group's fields (model tiny, hidden size 256, layers 4),
    which describe a model it did not build, and no peft."""
    from llmexp.report.run import settings_rows

    cfg = {"model": {"name": "tiny", "name_or_path": "/m", "hidden_size": 256, "num_hidden_layers": 4,
                     "parametrization": "standard", "width_mult": 1.0}, "peft": {"name": "lora"}, "lr": 1e-4}
    assert settings_rows(cfg) == [("model path", "/m"), ("lr", "1e-04"), ("peft", "lora")]
    built = settings_rows({**cfg, "model": {**cfg["model"], "name_or_path": None}})
    assert ("hidden size", "256") in built and ("model", "tiny") in built


def test_run_report_of_a_killed_run(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", history(num_steps=100), torn_tail=True)
    write_run_report(run)
    text = (run / "report.md").read_text()
    assert "no summary.json" in text and "| steps | 100 |" in text
    assert (run / "curves.png").stat().st_size > 10_000


def test_stability_measures_how_steadily_loss_fell() -> None:
    smooth = stability(history(noise=0.0))
    noisy = stability(history(noise=0.05, seed=3))
    assert smooth["rise_fraction"] == 0.0 and smooth["drop"] > 5
    assert noisy["rise_fraction"] > 0.2 and noisy["noise_to_drop"] > smooth["noise_to_drop"]
    assert stability([]) == {"drop": None, "rise_fraction": None, "noise_to_drop": None}


def make_sweep(root: Path) -> Path:
    """lr x batch_size, 2 x 3: job 5 killed (no summary), job 4 failed (job_status.json), job 1 with the
    lowest eval loss of all but a NaN (an error finding), so it must not be recommended."""
    (root / "multirun.yaml").parent.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    speeds = {"1e-4": 150.0, "3e-4": 60.0, "1e-3": 30.0}
    job = 0
    for lr in speeds:
        for bs, offset in (("2", 0.2), ("4", 0.0)):
            records = history(num_steps=300, seed=job,
                              loss=lambda s, v=speeds[lr], o=offset: 2 + o + 7 * math.exp(-s / v))
            overrides = (f"lr={lr}", f"batch_size={bs}")
            if job == 1:
                records[5]["loss"] = float("nan")
                records[-1]["eval_loss"] = 1.5
            if job == 5:
                make_run(root / str(job), [r for r in records if r["step"] <= 150], None, overrides)
            elif job == 4:
                make_run(root / str(job), [r for r in records if r["step"] <= 50], None, overrides,
                         {"status": "failed", "error": "RuntimeError: boom"})
            else:
                make_run(root / str(job), records, summary_of(records), overrides)
            job += 1
    return root


def test_sweep_report_covers_every_job_and_recommends_a_healthy_one(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "sweep")
    summary = write_sweep_report(sweep)
    on_disk = json.loads((sweep / "sweep_summary.json").read_text())
    assert on_disk["recommendation"] == summary["recommendation"]
    jobs = {j["job"]: j for j in on_disk["jobs"]}
    assert sorted(jobs) == [str(i) for i in range(6)]
    assert jobs["5"]["status"] == "failed" and "no summary.json" in jobs["5"]["error"]
    assert jobs["4"]["status"] == "failed" and jobs["4"]["error"] == "RuntimeError: boom"
    assert jobs["1"]["worst_severity"] == "error" and jobs["0"]["overrides"] == ["lr=1e-4", "batch_size=2"]
    assert on_disk["varying"] == ["lr", "batch_size"] and on_disk["all_finished"] is False
    rec = on_disk["recommendation"]
    finished_ok = [j for j in jobs.values() if j["status"] == "completed" and j["worst_severity"] != "error"]
    assert rec["job"] == min(finished_ok, key=lambda j: j["eval_loss"])["job"] == "3"
    assert "lowest final eval loss" in rec["reason"] and "rose on" in rec["reason"]
    text = (sweep / "sweep_report.md").read_text()
    assert "**Recommended:** `lr=3e-4 batch_size=4` (job 3)" in text
    assert text.count("\n| ") == 1 + 6  # header row + one row per job
    width, height = png_size(sweep / "sweep_curves.png")
    assert width / height > 2.8  # three panels: train, eval and the lr x batch_size heatmap


def test_sweep_with_one_parameter_has_no_heatmap(tmp_path: Path) -> None:
    for job, lr in enumerate(("1e-4", "3e-4")):
        records = history(num_steps=100, seed=job)
        make_run(tmp_path / str(job), records, summary_of(records), (f"lr={lr}", "batch_size=4"))
    summary = write_sweep_report(tmp_path)
    assert summary["varying"] == ["lr"] and summary["all_finished"] is True
    width, height = png_size(tmp_path / "sweep_curves.png")
    assert width / height < 2.8


def test_no_recommendation_when_every_job_is_broken(tmp_path: Path) -> None:
    records = history(num_steps=100)
    make_run(tmp_path / "0", records, summary_of(records, status="diverged"), ("lr=1",))
    make_run(tmp_path / "1", records, None, ("lr=2",))
    summary = write_sweep_report(tmp_path)
    assert summary["recommendation"] is None
    assert "no job finished without error findings" in (tmp_path / "sweep_report.md").read_text()


def test_varying_params_keeps_order_and_ignores_constants() -> None:
    jobs = [{"params": {"lr": "1", "seed": "0", "bs": "2"}}, {"params": {"lr": "2", "seed": "0", "bs": "4"}}]
    assert varying_params(jobs) == ["lr", "bs"]


def test_report_cli_picks_run_or_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = make_sweep(tmp_path / "sweep")
    assert report_main([str(sweep)]) == 1  # jobs failed: non-zero, like the sweep itself
    assert (sweep / "sweep_report.md").is_file()
    assert report_main([str(sweep / "0")]) == 0 and (sweep / "0" / "report.md").is_file()
    assert report_main([str(tmp_path / "nowhere")]) == 2
    assert "neither a run directory" in capsys.readouterr().err


def test_doctor_exit_codes_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    healthy = history()
    good = make_run(tmp_path / "good", healthy, summary_of(healthy))
    bad_records = broken_history()
    bad = make_run(tmp_path / "bad", bad_records, summary_of(bad_records))
    assert doctor.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "No findings" in out and "\033[" not in out  # no colour codes into a pipe
    assert (good / "report.md").is_file() and (good / "curves.png").is_file()
    assert doctor.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "ERROR   non_finite at step 610" in out and "advice:" in out and "bf16" not in out
    assert "`overfitting` at step 400" in (bad / "report.md").read_text()
    make_sweep(tmp_path / "sweep")
    assert doctor.main([str(tmp_path / "sweep")]) == 2
    assert "It is a sweep directory" in capsys.readouterr().err
    proc = run_cli([str(tmp_path / "good" / ".hydra")], module="llmexp.doctor", timeout_s=120)  # the real CLI
    assert proc.returncode == 2 and "is not a run directory" in proc.stderr


def test_the_doctor_counts_the_steps_a_run_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose every step spiked and was skipped until it diverged at step 6 reached step 6, though it logged no
    `train` record (the header said "0 steps")."""
    records = [{"event": "start", "step": 0}] + [
        {"event": "anomaly", "step": s, "loss": 3e3, "grad_norm": 1e4, "policy": "skip",
         "action": "diverged" if s == 6 else "skipped"} for s in range(1, 7)]
    run = make_run(tmp_path / "run", records, {"status": "diverged", "step": 6, "findings": []})
    doctor.main([str(run)])
    assert f"{run}: status diverged, 6 steps, 7 metric records" in capsys.readouterr().out


def test_the_doctor_says_a_run_is_running_while_its_process_holds_it(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A run that resumed after a preemption: summary.json says how its first segment ended, the lock says it runs."""
    from filelock import FileLock

    from llmexp.rundir.lock import LOCK_NAME

    records = history(num_steps=20)
    run = make_run(tmp_path / "run", records, {**summary_of(records), "status": "preempted"})
    with FileLock(str(run / LOCK_NAME)):
        doctor.main([str(run)])
        assert f"{run}: status running (pid {os.getpid()})," in capsys.readouterr().out
    doctor.main([str(run)])
    assert f"{run}: status preempted," in capsys.readouterr().out


def test_the_doctor_names_why_a_sweep_job_failed_before_any_summary(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """It said "no summary.json (killed, or still running) ... No findings: the run looks healthy", exit 0."""
    run = make_run(tmp_path / "1", [], job_status={"num": 1, "status": "failed", "exit_code": 2,
                                                    "error": "optimizer: Invalid epsilon value: -1"})
    assert doctor.main([str(run)]) == 1
    out = capsys.readouterr().out
    assert f"{run}: status failed (optimizer: Invalid epsilon value: -1)" in out and "healthy" not in out


def test_a_huge_train_loss_has_an_infinite_train_ppl_in_the_sweep_report(tmp_path: Path) -> None:
    """It showed exp(50) = 5.185e+21 beside a loss of 2.2e7."""
    from llmexp.report.sweep import collect_job

    records = history(num_steps=10)
    job = make_run(tmp_path / "0", records, {**summary_of(records), "train_loss": 2.2e7})
    assert collect_job(job, records)["train_ppl"] == math.inf


def test_a_recommended_runs_loss_that_ended_higher_is_not_said_to_fall() -> None:
    """It said "its train loss fell -0.0157 nats"."""
    from llmexp.report.sweep import recommend

    job = {"job": "0", "status": "completed", "worst_severity": None, "metric": "eval_loss", "direction": "minimize",
           "metric_value": 2.0, "eval_loss": 2.0, "params": {"lr": "1e-3"}, "overrides": ["lr=1e-3"],
           "stability": {"drop": -0.0157, "rise_fraction": 0.6}}
    rec = recommend([job], ["lr"])
    assert rec is not None and "its train loss ended 0.0157 nats above its start and rose on 60%" in rec["reason"]


def test_recommendation_averages_over_seeds(tmp_path: Path) -> None:
    """lr=1e-3 wins one seed by luck, lr=3e-4 wins on average: 3e-4 is recommended, named without the seed."""
    finals = {("1e-3", "0"): 2.0, ("1e-3", "1"): 3.0, ("3e-4", "0"): 2.2, ("3e-4", "1"): 2.3}
    for job, ((lr, seed), final) in enumerate(finals.items()):
        records = history(num_steps=100, seed=job, eval_loss=lambda s, f=final: f + 5 * (1 - s / 100))
        make_run(tmp_path / str(job), records, summary_of(records), ("train.max_steps=100", f"lr={lr}", f"seed={seed}"))
    summary = write_sweep_report(tmp_path)
    rec = summary["recommendation"]
    assert rec["settings"] == "lr=3e-4" and rec["eval_loss"] == pytest.approx(2.25, abs=0.05)
    assert "mean over 2 runs" in rec["reason"] and "runner-up `lr=1e-3`" in rec["reason"]
    text = (tmp_path / "sweep_report.md").read_text()
    assert "**Common overrides:** `train.max_steps=100`" in text and "| `lr=3e-4 seed=1` |" in text


def test_report_and_doctor_keep_a_printed_finding_resolved_later(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The console printed a perplexity finding at step 100 that the run later outgrew: report.md and the
    doctor list it as resolved (not dropped), and it counts towards neither health nor the exit code."""
    from llmexp.monitor.detectors import MonitorSettings
    from tests.test_monitor import live

    records = live(history(num_steps=400, eval_loss=lambda s: 6.5 if s <= 100 else 3.0), MonitorSettings())
    assert any(r["event"] == "finding" and r["kind"] == "ppl_range" for r in records)
    run = make_run(tmp_path / "run", records, summary_of(records))
    assert doctor.main([str(run)]) == 0
    assert "ppl_range at step 100 (resolved at step 200)" in capsys.readouterr().out
    text = (run / "report.md").read_text()
    assert "`ppl_range` at step 100 **(resolved at step 200)**" in text
    assert "(0 error, 0 warning, 0 info; 1 resolved)" in text and "**health:** healthy" in text


GRID = "hydra_plugins.llmexp_sweeper.llmexp_sweeper.GridSweeper"


def write_multirun(sweep: Path, task: list[str], sweeper: str = GRID, zip_keys: tuple[str, ...] = (),
                   lr_scaling: str = "none") -> None:
    """The multirun.yaml a sweep of `task` (its command line) leaves, with llmexp's `${sweep.x}` interpolations."""
    sweep.mkdir(parents=True, exist_ok=True)
    config = {"sweep": {"zip": list(zip_keys), "lr_scaling": lr_scaling},
              "hydra": {"sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
                        "sweeper": {"_target_": sweeper, "zip": "${sweep.zip}", "lr_scaling": "${sweep.lr_scaling}",
                                    "params": None},
                        "overrides": {"hydra": [f"hydra.sweep.dir={sweep}"], "task": task}}}
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(config))


def make_grid(sweep: Path, task: list[str], jobs: dict[str, tuple[str, ...]]) -> Path:
    """A finished grid sweep of `task` that holds the directories of `jobs` (job number -> overrides)."""
    write_multirun(sweep, task)
    for num, (name, overrides) in enumerate(jobs.items()):
        records = history(num_steps=100, seed=num)
        make_run(sweep / name, records, summary_of(records), overrides)
    return sweep


def test_a_launched_job_whose_directory_is_gone_is_listed_missing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`rm -rf SWEEP/2`: multirun.yaml still says the sweep launched it, so the report lists it (with its
    overrides), counts it, and the sweep is not finished (exit 1: the sweep's command runs it again)."""
    steps = "train.max_steps=4"
    sweep = make_grid(tmp_path / "sweep", ["lr=1e-3,2e-3", "seed=0,1", steps],
                      {"0": ("lr=0.001", "seed=0", steps), "1": ("lr=0.001", "seed=1", steps),
                       "3": ("lr=0.002", "seed=1", steps)})
    assert report_main([str(sweep)]) == 1
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert [j["job"] for j in summary["jobs"]] == ["0", "1", "2", "3"] and summary["num_jobs"] == 4
    gone = summary["jobs"][2]
    assert gone["status"] == "missing" and gone["overrides"] == ["lr=0.002", "seed=0", "train.max_steps=4"]
    assert summary["status_counts"] == {"completed": 3, "missing": 1} and summary["all_finished"] is False
    assert "| 2 | `lr=0.002 seed=0` | missing (its directory is gone; the sweep's command runs it again)" in \
        (sweep / "sweep_report.md").read_text()
    assert "4 jobs {'completed': 3, 'missing': 1}" in capsys.readouterr().out


def test_launched_jobs_are_the_grid_the_sweeper_ran(tmp_path: Path) -> None:
    """The product in command-line order, `sweep.zip` keys paired, an lr scaled per job left out; nothing for a
    search, whose trials are in its study."""
    from llmexp.rundir.read import launched_jobs

    write_multirun(tmp_path / "grid", ["lr=1e-3,2e-3", "+tag=a,b", "train.max_steps=4"])
    assert launched_jobs(tmp_path / "grid") == {"0": ["lr=0.001", "+tag=a", "train.max_steps=4"],
                                                "1": ["lr=0.001", "+tag=b", "train.max_steps=4"],
                                                "2": ["lr=0.002", "+tag=a", "train.max_steps=4"],
                                                "3": ["lr=0.002", "+tag=b", "train.max_steps=4"]}
    write_multirun(tmp_path / "zip", ["lr=1,2", "batch_size=4,8", "seed=0,1"], zip_keys=("lr", "batch_size"))
    assert list(launched_jobs(tmp_path / "zip").values()) == [
        ["lr=1", "batch_size=4", "seed=0"], ["lr=1", "batch_size=4", "seed=1"],
        ["lr=2", "batch_size=8", "seed=0"], ["lr=2", "batch_size=8", "seed=1"]]
    write_multirun(tmp_path / "scaled", ["lr=1e-3", "batch_size=4,8"], lr_scaling="sqrt")
    assert list(launched_jobs(tmp_path / "scaled").values()) == [["batch_size=4"], ["batch_size=8"]]
    write_multirun(tmp_path / "tpe", ["lr=tag(log,interval(1e-4,1e-2))"],
                   sweeper="hydra_plugins.llmexp_sweeper.llmexp_sweeper.SearchSweeper")
    assert launched_jobs(tmp_path / "tpe") == {}


def test_a_recommendation_names_the_swept_keys_where_the_jobs_repeat_a_value(tmp_path: Path) -> None:
    """`lr=1e-3,1e-3 seed=0,1`: lr takes one value in every job, yet it is what the sweep swept, so it names
    the setting, never `(defaults)`; the table shows it too."""
    sweep = make_grid(tmp_path / "sweep", ["lr=1e-3,1e-3", "seed=0,1"],
                      {"0": ("lr=0.001", "seed=0"), "1": ("lr=0.001", "seed=1"),
                       "2": ("lr=0.001", "seed=0"), "3": ("lr=0.001", "seed=1")})
    summary = write_sweep_report(sweep)
    assert summary["varying"] == ["lr", "seed"]
    assert summary["recommendation"]["settings"] == "lr=0.001"
    text = (sweep / "sweep_report.md").read_text()
    assert "**Recommended:** `lr=0.001`" in text and "| 1 | `lr=0.001 seed=1` |" in text


def test_one_rule_says_what_sets_jobs_apart() -> None:
    """The sweep's log lines (`sweep.jobs.swept`) and the status (`rundir.read.shown_overrides`) agree, also
    where nothing differs: then a job shows all its overrides."""
    from llmexp.rundir.read import shown_overrides, varying_keys
    from llmexp.sweep.jobs import swept

    for jobs in ([["lr=1", "seed=0"], ["lr=1", "seed=1"]], [["lr=1"], ["lr=1"]], [["lr=1", "x=2"], ["lr=1"]]):
        assert [swept(job, jobs) for job in jobs] == [shown_overrides(job, varying_keys(jobs)) for job in jobs]
    assert swept(["lr=1"], [["lr=1"], ["lr=1"]]) == "lr=1"
    assert swept(["lr=1", "seed=0"], [["lr=1", "seed=0"], ["lr=1", "seed=1"]], ["lr", "seed"]) == "lr=1 seed=0"
