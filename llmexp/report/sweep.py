"""The sweep report (`python -m llmexp.report SWEEP_DIR`): one table, one recommendation and one plot over a
sweep's job directories, read with the loaders of `llmexp.rundir.read` as the run report does, and a search's
optuna study with `llmexp.report.search`. Works at any time, also in the middle of a sweep."""

from __future__ import annotations

import itertools
import json
import logging
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from llmexp.monitor.detectors import ERROR, worst_severity
from llmexp.monitor.logger import safe_exp
from llmexp.report.findings import run_findings
from llmexp.report.formats import fmt, fmt_rate, is_finite, md_table
from llmexp.report.search import PRUNED, load_study, search_markdown, search_summary
from llmexp.rundir import read
from llmexp.rundir.files import write_text_atomic
from llmexp.rundir.lock import lock_holder
from llmexp.rundir.task_metrics import final_tasks, metric_value

log = logging.getLogger(__name__)


def stability(records: list[dict]) -> dict[str, float | None]:
    """How steadily a run's train loss fell: its drop, the share of logged steps where it rose,
    and its noise (median deviation from a 5-point running median) relative to the drop."""
    losses = [float(r["loss"]) for r in records if r.get("event") == "train" and is_finite(r.get("loss"))]
    if len(losses) < 3:
        return {"drop": None, "rise_fraction": None, "noise_to_drop": None}
    k = min(3, len(losses) // 2)
    drop = statistics.median(losses[:k]) - statistics.median(losses[-k:])
    rises = sum(b > a for a, b in itertools.pairwise(losses)) / (len(losses) - 1)
    resid = [abs(v - statistics.median(losses[max(0, i - 2):i + 3])) for i, v in enumerate(losses)]
    return {"drop": round(drop, 4), "rise_fraction": round(rises, 3),
            "noise_to_drop": round(statistics.median(resid) / drop, 4) if drop > 0 else None}


def _param_dict(overrides: list[str]) -> dict[str, str]:
    return {key: value for key, sep, value in (o.lstrip("+~").partition("=") for o in overrides) if sep}


def collect_job(job_dir: Path, records: list[dict], launched: list[str] | None = None) -> dict[str, Any]:
    """One sweep job's entry from its directory and metrics: overrides, status, final metrics, findings and loss
    stability; `launched`: the overrides the sweep's record gives a job whose directory is gone."""
    summary = read.load_summary(job_dir)
    job_status = read.load_job_status(job_dir)
    overrides = read.load_overrides(job_dir) if launched is None else launched
    entry: dict[str, Any] = {"job": job_dir.name, "dir": str(job_dir), "overrides": overrides,
                             "params": _param_dict(overrides)}
    if launched is not None:  # (multirun.yaml launched it; nothing of it is left to read)
        entry["status"] = read.missing_status(job_dir.parent)
        entry["error"] = ("its directory is gone; the sweep's command runs it again" if entry["status"] == "missing"
                          else None)
    elif summary is not None:
        # The launcher writes job_status.json only when it knows more than the trainer (e.g. SLURM cancelled it).
        entry["status"] = job_status.get("status") or summary.get("status", "unknown")
        entry["error"] = job_status.get("error")
    elif lock_holder(job_dir) is not None:  # mid-sweep: its process holds the run directory
        entry["status"], entry["error"] = "running", None
    elif job_status.get("status") == "queued" and lock_holder(job_dir.parent) is None:  # as `llmexp.status` says
        entry["status"], entry["error"] = "not_started", "its sweeper stopped first; the sweep's command runs it"
    else:
        entry["status"] = job_status.get("status", "failed")
        damaged = read.summary_damaged(job_dir, summary)
        entry["error"] = job_status.get("error") or (f"{job_dir / 'summary.json'} is damaged (not a JSON object)"
                                                     if damaged else "no summary.json: the job was killed or crashed")
    for key, event, rec_key in (("step", "train", "step"), ("train_loss", "train", "loss"),
                                ("train_ppl", "train", "ppl"), ("eval_loss", "eval", "eval_loss"),
                                ("eval_ppl", "eval", "eval_ppl"), ("tokens_per_sec", "train", "tokens_per_sec")):
        value = (summary or {}).get(key)
        entry[key] = value if value is not None else read.last_value(records, event, rec_key)
    if isinstance(entry["train_loss"], int | float) and (summary or {}).get("train_loss") is not None:
        entry["train_ppl"] = safe_exp(entry["train_loss"])  # consistent with the loss shown (inf past e^709)
    config = read.load_config(job_dir)  # a job from before sweep.metric and sweep.direction: the eval loss, minimised
    entry["metric"] = str(read.config_value(config, "sweep.metric") or "eval_loss")
    entry["direction"] = str(read.config_value(config, "sweep.direction") or "minimize")
    entry["metric_value"] = metric_value(entry["metric"], summary, records)  # what the recommendation ranks by
    entry["tasks"] = (summary or {}).get("tasks") or final_tasks(records)
    entry["findings"] = run_findings(job_dir, records)
    entry["worst_severity"] = worst_severity(entry["findings"])
    entry["stability"] = stability(records)
    return entry


def varying_params(jobs: list[dict], swept: list[str] | None = None) -> list[str]:
    """The keys that tell the jobs apart: `rundir.read.varying_keys` of their params (`swept`: the sweep's record)."""
    return read.varying_keys([[f"{k}={v}" for k, v in job["params"].items()] for job in jobs], swept or [])


REPLICATE_KEYS = ("seed", "train.seed_data")
"""Swept keys that repeat a setting rather than change it: the recommendation averages over them."""


def _swept(job: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={job['params'].get(k)}" for k in keys) or "(defaults)"


def recommend(jobs: list[dict], varying: list[str]) -> dict[str, Any] | None:
    """The recommended setting, chosen as docs/how-to/sweeps.md says (`sweep.metric` among finished jobs with no
    error findings, the mean over seeds), with the reason and how stably its loss fell."""
    ok = [j for j in jobs if j["status"] in read.FINISHED and j["worst_severity"] != ERROR
          and is_finite(j["metric_value"])]
    if not ok:
        return None
    metric, direction = jobs[0]["metric"], jobs[0]["direction"]  # the jobs of one sweep share them
    sign = -1.0 if direction == "maximize" else 1.0
    keys = [k for k in varying if k not in REPLICATE_KEYS] or varying
    groups: dict[str, list[dict]] = {}
    for j in ok:
        groups.setdefault(_swept(j, keys), []).append(j)
    mean = {name: statistics.fmean(j["metric_value"] for j in members) for name, members in groups.items()}
    ranked = sorted(groups, key=lambda name: sign * mean[name])
    best_name = ranked[0]
    best = min(groups[best_name], key=lambda j: sign * j["metric_value"])
    runs = len(groups[best_name])
    what = f"mean over {runs} runs " if runs > 1 else ""
    shown = "eval loss" if metric == "eval_loss" else metric
    reason = (f"{'highest' if sign < 0 else 'lowest'} final {shown} ({what}{mean[best_name]:.4g}) among "
              f"{len(ok)} finished job(s) with no error findings ({len(jobs) - len(ok)} excluded)")
    if len(ranked) > 1:
        reason += f"; runner-up `{ranked[1]}` at {mean[ranked[1]]:.4g}"
    stab = [j["stability"] for j in groups[best_name] if j["stability"]["rise_fraction"] is not None]
    if stab:
        drop = statistics.fmean(x["drop"] for x in stab)
        moved = f"fell {drop:.3g} nats" if drop >= 0 else f"ended {-drop:.3g} nats above its start"  # (not "fell -x")
        reason += (f"; its train loss {moved} and rose on "
                   f"{statistics.fmean(x['rise_fraction'] for x in stab):.0%} of logged steps")
    losses = [j["eval_loss"] for j in groups[best_name] if isinstance(j.get("eval_loss"), int | float)]
    return {"job": best["job"], "settings": best_name, "overrides": best["overrides"], "params": best["params"],
            "eval_loss": statistics.fmean(losses) if losses else None, "metric": metric, "direction": direction,
            "value": mean[best_name], "reason": reason}


def sweep_report_markdown(summary: dict) -> str:
    rec, varying, jobs = summary["recommendation"], summary["varying"], summary["jobs"]
    # a column for sweep.metric when it is not the eval loss (the jobs of one sweep share it)
    metric = next((j["metric"] for j in jobs if j.get("metric") not in (None, "eval_loss")), None)
    common = [o for o in (jobs[0]["overrides"] if jobs else []) if read.override_key(o) not in varying
              and all(o in j["overrides"] for j in jobs)]
    lines = [f"# Sweep report: {Path(summary['sweep_dir']).name}\n",
             f"**Jobs:** {summary['num_jobs']} (" + ", ".join(f"{n} {s}" for s, n in summary["status_counts"].items())
             + ")" + (f" · **swept:** {', '.join(varying)}" if varying else "") + "\n",
             f"**Common overrides:** `{' '.join(common)}`\n" if common else "",
             f"**Recommended:** `{rec['settings']}` (job {rec['job']}): {rec['reason']}.\n" if rec else
             "**Recommended:** none: no job finished without error findings.\n"]
    table = []
    for j in jobs:
        found = ", ".join(f"{f['severity']}:{f['kind']}@{f['step']}" for f in j["findings"]) or "–"
        status = j["status"] + (f" ({j['error']})" if j.get("error") and j["status"] not in read.FINISHED else "")
        rise = j["stability"]["rise_fraction"]
        table.append([str(j["job"]), f"`{_swept(j, varying) if varying else ' '.join(j['overrides'])}`", status,
                      fmt(j["train_loss"]), fmt(j["train_ppl"]), fmt(j["eval_loss"]), fmt(j["eval_ppl"]),
                      *([fmt(j.get("metric_value"))] if metric else []), fmt_rate(j["tokens_per_sec"]),
                      "–" if rise is None else f"{rise:.0%}", found])
    lines += md_table(["job", "settings", "status", "train loss", "train ppl", "eval loss", "eval ppl",
                       *([metric] if metric else []), "tokens/s", "loss rose on", "findings"], table)
    lines += ["", "*loss rose on*: the share of logged steps where the train loss went up (lower is steadier). "
              "Every job's full overrides are in sweep_summary.json.", "", "![sweep curves](sweep_curves.png)", ""]
    if summary.get("search_error"):
        lines += [f"**Search:** the optuna study {summary['search_error']}; the table above is read from the "
                  "job directories alone.", ""]
    if summary.get("search"):
        lines += search_markdown(summary["search"])
    return "\n".join(lines)


def write_sweep_report(sweep_dir: Path) -> dict[str, Any]:
    """Write sweep_summary.json, sweep_report.md, sweep_curves.png (a search: sweep_search.png); return the summary."""
    from llmexp.report.plots import plot_search, plot_sweep

    sweep_dir = Path(sweep_dir)
    curves = {d.name: read.load_records(d) for d in read.job_dirs(sweep_dir)}
    jobs = [collect_job(sweep_dir / name, records) for name, records in curves.items()]
    jobs += [collect_job(sweep_dir / name, [], launched) for name, launched in read.launched_jobs(sweep_dir).items()
             if name not in curves]  # launched, its directory gone: listed, counted, and the sweep not finished
    jobs.sort(key=lambda j: read.job_order(j["job"]))
    study, search_error = load_study(sweep_dir)
    search = search_summary(sweep_dir, study, jobs) if study is not None else None  # marks running jobs
    counts = dict(Counter(j["status"] for j in jobs))
    varying = varying_params(jobs, read.swept_keys(sweep_dir))
    rec = recommend(jobs, varying)
    summary = {"sweep_dir": str(sweep_dir), "num_jobs": len(jobs), "status_counts": counts,
               # A pruned trial ended as the search intended: it does not make the sweep unfinished.
               "all_finished": all(j["status"] in (*read.FINISHED, PRUNED) for j in jobs), "varying": varying,
               "recommendation": rec, "jobs": jobs, "search": search, "search_error": search_error}
    title = sweep_dir.resolve().name + (f"  ·  recommended: {rec['settings']}" if rec else "")
    plot_sweep(jobs, curves, varying, sweep_dir / "sweep_curves.png", title=title,
               recommended=rec["job"] if rec else None)
    if search is not None:
        plot_search(search, sweep_dir / "sweep_search.png", title=sweep_dir.resolve().name)
    write_text_atomic(sweep_dir / "sweep_summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    write_text_atomic(sweep_dir / "sweep_report.md", sweep_report_markdown(summary))
    _upload(sweep_dir)
    return summary


def _upload(sweep_dir: Path) -> None:
    """The report as artifacts of the sweep's MLflow parent run, if it has one; the files stand without it."""
    from llmexp.monitor.mlflow_sink import log_sweep_report
    from llmexp.rundir.redact import scrub_text

    try:
        log_sweep_report(sweep_dir)
    except Exception as err:  # no mlflow installed, server down: the report on disk is what counts
        log.warning(f"mlflow: the sweep report was not uploaded to the parent run ({type(err).__name__}: "
                    f"{scrub_text(str(err))[:300]})")
