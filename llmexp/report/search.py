"""The search part of a sweep report (`sweep=random|tpe`; what it shows: docs/how-to/sweeps.md): the optuna study
(`rundir.study.load_study`), trial N being job `SWEEP_DIR/N`. A pure function of the study's journal and the job
directories, so it can be written while the sweeper still appends to the journal (optuna's file backend reads only
whole lines, and a torn last line is skipped until it is complete). A grid sweep has no study.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmexp.report.formats import fmt, md_table
from llmexp.rundir import read
from llmexp.rundir.readers import read_yaml
from llmexp.rundir.study import load_study as open_study
from llmexp.rundir.study import study_journal

PRUNED = "pruned"
"""A run's status (summary.json) when the sweeper pruned it: it stopped early, on purpose, with a checkpoint."""
RUNNING = "running"
"""A job's status in the report while its trial is RUNNING in the study and it has no summary.json yet."""
STOPPED = "stopped"
"""A trial still RUNNING in the study whose run stopped with a summary (preempted, interrupted): a rerun resumes it."""


def load_study(sweep_dir: Path) -> tuple[Any | None, str | None]:
    """(the study, None), (None, None) for a sweep without one (a grid), or (None, why) when the journal
    exists but cannot be read, which the report says in one line rather than failing."""
    path = study_journal(sweep_dir)
    if not path.is_file():
        return None, None
    try:
        return open_study(sweep_dir), None
    except (ValueError, OSError) as err:  # a damaged journal (a UserError), or one that cannot be opened
        return None, f"{path} could not be read ({type(err).__name__}: {err})"


def search_setup(sweep_dir: Path, jobs: list[dict]) -> dict[str, Any]:
    """The search's settings as the sweep was started with (`multirun.yaml`, else the first job's config)."""
    config = read_yaml(Path(sweep_dir) / "multirun.yaml")
    if not isinstance(config, dict) or not isinstance(config.get("sweep"), dict):
        config = read.load_config(Path(jobs[0]["dir"])) if jobs else {}
    keys = {"sampler": "sweep.name", "pruner": "sweep.pruner", "n_trials": "sweep.n_trials", "seed": "sweep.seed",
            "parallel": "sweep.parallel", "max_steps": "train.max_steps"}
    return {name: read.config_value(config, key) for name, key in keys.items()}


def _space(trials: list[Any]) -> dict[str, str]:
    """Each searched parameter's distribution, in words: `log-uniform [1e-05, 0.1]`, `one of [2, 4]`."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space: dict[str, str] = {}
    for trial in trials:
        for name, dist in trial.distributions.items():
            if name in space:
                continue
            if isinstance(dist, FloatDistribution | IntDistribution):
                kind = "log-uniform" if dist.log else "uniform"
                kind += f" step {dist.step:g}" if dist.step not in (None, 1) else ""
                space[name] = f"{kind} [{fmt(dist.low)}, {fmt(dist.high)}]" + (
                    " (integers)" if isinstance(dist, IntDistribution) else "")
            elif isinstance(dist, CategoricalDistribution):
                space[name] = "one of [" + ", ".join(str(c) for c in dist.choices) + "]"
    return space


def trial_rows(study: Any, jobs_by_name: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per trial, in trial order (a running trial's job marked so); its curve: the intermediate values
    pruning saw."""
    sign = _sign(study)  # best = lowest of sign * value
    rows, best = [], math.inf
    for trial in study.get_trials(deepcopy=False):
        state = trial.state.name.lower()
        if trial.user_attrs.get("status") == "failed":
            # The sweeper tells a run that failed on a doctor's error as PRUNED (TPE learns nothing from FAIL):
            # for the sampler a bad region, for the reader a failure.
            state = "fail"
        value = trial.value if state == "complete" else None
        if value is not None and math.isfinite(value):
            best = min(best, sign * value)
        job = jobs_by_name.get(str(trial.number), {})
        # A live (or killed) trial's job has no summary.json yet: it is running, not failed. One with a summary
        # (preempted, interrupted) is stopped: the same command resumes it.
        if job and state == RUNNING:
            if (summary := read.load_summary(Path(job["dir"]))) is None:
                job["status"], job["error"] = RUNNING, None
            else:
                state = f"{STOPPED} ({summary.get('status')})"
        curve = sorted((int(step), float(v)) for step, v in trial.intermediate_values.items())
        steps = job.get("step") if isinstance(job.get("step"), int) else curve[-1][0] if curve else None
        stopped = trial.user_attrs.get("stopped_step")
        rows.append({"number": trial.number, "params": dict(trial.params), "state": state, "value": value,
                     "best_so_far": sign * best if math.isfinite(best) else None, "steps": steps or 0,
                     "stopped_step": (stopped if isinstance(stopped, int) else steps) if state == PRUNED else None,
                     "last_eval_loss": curve[-1][1] if curve else job.get("eval_loss"),
                     "reason": trial.user_attrs.get("reason"), "run_status": trial.user_attrs.get("status"),
                     "curve": curve})
    return rows


def importances(study: Any, rows: list[dict]) -> tuple[dict[str, float] | None, str | None]:
    """PED-ANOVA importances of the searched parameters (`optuna.importance`), or None and why not.

    PED-ANOVA rather than optuna's default fANOVA: fANOVA needs scikit-learn, which llmexp does not install,
    and PED-ANOVA (which asks what sets the best trials apart) is meant for a few dozen trials, a sweep's size."""
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    complete = [r for r in rows if r["state"] == "complete"]
    names = sorted({name for r in complete for name in r["params"]})
    if len(complete) < 2:
        return None, f"not computed: {len(complete)} complete trial(s); it takes at least 2"
    if len(names) < 2:
        return None, (f"not computed: one parameter searched (`{names[0] if names else '?'}`); importances "
                      "compare two or more")
    try:
        found = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError) as err:  # e.g. every complete trial has the same value
        return None, f"not computed: {err}"
    return {name: round(float(v), 4) for name, v in found.items()}, None


def search_summary(sweep_dir: Path, study: Any, jobs: list[dict]) -> dict[str, Any]:
    """The `search` entry of sweep_summary.json; marks the jobs whose trial still runs as running."""
    rows = trial_rows(study, {j["job"]: j for j in jobs})
    setup = search_setup(sweep_dir, jobs)
    counts = {s: sum(r["state"].split(" ")[0] == s for r in rows) for s in ("complete", PRUNED, "fail", RUNNING,
                                                                            STOPPED)}
    spent = sum(r["steps"] for r in rows)
    budget = setup["n_trials"] * setup["max_steps"] if isinstance(setup["n_trials"], int) and isinstance(
        setup["max_steps"], int) else None
    complete = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    best = min(complete, key=lambda r: _sign(study) * r["value"]) if complete else None
    found, note = importances(study, rows)
    return {**setup, "metric": study.user_attrs.get("metric", "eval_loss"),  # studies from before sweep.metric
            "direction": study.direction.name.lower(),
            "space": _space(study.get_trials(deepcopy=False)), "counts": counts, "steps_spent": spent,
            "steps_budget": budget, "best_trial": best["number"] if best else None,
            "best_value": best["value"] if best else None, "importances": found, "importances_note": note,
            "trials": rows}


def _sign(study: Any) -> float:
    return -1.0 if study.direction.name == "MAXIMIZE" else 1.0


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={fmt(v)}" for k, v in params.items()) or "–"


def search_markdown(search: dict[str, Any]) -> list[str]:
    """The report's search section: setup and counts, history, pruned trials, importances."""
    counts, rows = search["counts"], search["trials"]
    metric = search["metric"]
    label = "eval loss" if metric == "eval_loss" else f"`{metric}`"
    spent, budget = search["steps_spent"], search["steps_budget"]
    share = f" = {spent / budget:.0%}" if budget else ""
    lines = ["", f"## Search: {search['sampler']}, pruner {search['pruner']}", "",
             f"**Trials:** {len(rows)} of sweep.n_trials={search['n_trials']} (seed {search['seed']}, "
             f"{search['parallel']} at once): {counts['complete']} complete, {counts[PRUNED]} pruned, "
             f"{counts['fail']} failed, {counts[RUNNING]} running, {counts[STOPPED]} stopped · **training steps "
             f"spent:** {spent:,} of "
             + (f"{budget:,} (n_trials × train.max_steps {search['max_steps']}){share}" if budget else "–"), ""]
    lines += ["**Search space:** " + ", ".join(f"`{k}` {v}" for k, v in search["space"].items()), ""]
    if search["best_trial"] is not None:
        best = next(r for r in rows if r["number"] == search["best_trial"])
        lines += [f"**Best trial:** {best['number']}, {label} {fmt(best['value'])}, "
                  f"`{_params_text(best['params'])}`", ""]
    names = list(search["space"])
    history = []
    for r in rows:
        reason = r["reason"] if not r["reason"] or len(r["reason"]) <= 80 else r["reason"][:77] + "..."
        state = r["state"] + (f" at step {r['stopped_step']}" if r["state"] == PRUNED else "") + (
            f" ({reason})" if reason and r["state"] == "fail" else "")
        value = fmt(r["value"]) if r["value"] is not None else (
            f"({fmt(r['last_eval_loss'])} last)" if r["last_eval_loss"] is not None else "–")
        history.append([str(r["number"]), *(fmt(r["params"].get(n)) for n in names), state, value,
                        fmt(r["best_so_far"]), f"{r['steps']:,}"])
    lines += ["### Optimisation history", "",
              *md_table(["trial", *names, "state", label, "best so far", "steps"], history)]
    pruned = [r for r in rows if r["state"] == PRUNED]
    if pruned:
        lines += ["", "### Pruned trials", "",
                  *md_table(["trial", "settings", "stopped at step", f"last {label}"],
                            ([str(r["number"]), f"`{_params_text(r['params'])}`", str(r["stopped_step"]),
                              fmt(r["last_eval_loss"])] for r in pruned))]
    lines += ["", "### Parameter importances (PED-ANOVA, `optuna.importance`)", ""]
    if importances := search["importances"]:
        lines += md_table(["parameter", "importance"], ([f"`{k}`", f"{v:.2f}"] for k, v in importances.items()))
    else:
        lines.append(search["importances_note"])
    lines += ["", f"*{label}*: a complete trial's final {label} (the objective, {search['direction']}d); a pruned or "
              "running trial's latest is shown in brackets. *steps*: training steps the trial ran. A failed trial's "
              "full reason is in sweep_summary.json.", "",
              "![search history](sweep_search.png)", ""]
    return lines
