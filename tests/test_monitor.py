"""Detectors on synthetic metric histories: each pattern is planted, and a healthy run must stay clean."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from llmexp.monitor.detectors import (
    ERROR,
    Finding,
    MonitorSettings,
    diagnose,
    is_spike,
    reconcile,
    settings_from_config,
    worst_severity,
)


def healthy_loss(step: int) -> float:
    return 2.0 + 7.0 * math.exp(-step / 80)


def history(num_steps: int = 300, loss: Callable[[int], float] = healthy_loss,
            grad_norm: Callable[[int], float] = lambda s: 1.0, eval_loss: Callable[[int], float] | None = None,
            logging_steps: int = 10, eval_steps: int = 100, noise: float = 0.02, seed: int = 0) -> list[dict]:
    """A metrics.jsonl history: train records every logging_steps, evals at 0, every eval_steps and the end."""
    rng = random.Random(seed)
    eval_loss = eval_loss or (lambda s: loss(s) + 0.1)
    records: list[dict] = []
    for step in range(0, num_steps + 1):
        if step > 0 and step % logging_steps == 0:
            value = loss(step) * (1 + noise * rng.gauss(0, 1))
            records.append({"event": "train", "step": step, "loss": value, "ppl": math.exp(min(value, 50)),
                            "lr": 3e-4, "grad_norm": grad_norm(step) * (1 + noise * rng.gauss(0, 1)),
                            "tokens_per_sec": 1000.0, "skipped_steps": 0})
        if step % eval_steps == 0 or step == num_steps:
            value = eval_loss(step) * (1 + noise / 4 * rng.gauss(0, 1))
            records.append({"event": "eval", "step": step, "eval_loss": value, "eval_ppl": math.exp(min(value, 50))})
    return records


def kinds(findings: list[Finding], severity: str | None = None) -> set[str]:
    return {f.kind for f in findings if severity is None or f.severity == severity}


@pytest.mark.parametrize("seed", range(10))
def test_healthy_run_has_no_errors_or_warnings(seed: int) -> None:
    findings = diagnose(history(seed=seed), MonitorSettings())
    assert not kinds(findings, ERROR), findings
    assert not kinds(findings, "warning"), findings


def test_finding_round_trips_to_dict() -> None:
    f = Finding("plateau", 3, "warning", "m", "a")
    assert Finding(**f.to_dict()) == f
    assert worst_severity([f, {"severity": "error"}]) == ERROR
    assert worst_severity([]) is None


def test_non_finite_loss_is_an_error_with_clipping_and_bf16_advice() -> None:
    records = history()
    records.insert(10, {"event": "train", "step": 105, "loss": float("nan"), "grad_norm": float("inf")})
    settings = MonitorSettings(precision="fp16", max_grad_norm=0.0)
    found = [f for f in diagnose(records, settings) if f.kind == "non_finite"]
    assert len(found) == 1 and found[0].severity == ERROR and found[0].step == 105
    assert "bf16" in found[0].advice.lower() and "max_grad_norm=1.0" in found[0].advice


def test_null_loss_and_anomaly_events_count_as_non_finite() -> None:
    records = [*history(num_steps=50), {"event": "anomaly", "step": 51, "loss": None, "grad_norm": 3.0,
                                        "action": "skip"}]
    found = [f for f in diagnose(records, MonitorSettings()) if f.kind == "non_finite"]
    assert found and found[0].step == 51


def test_fp16_scaler_overflow_is_not_an_error() -> None:
    records = history()
    records[3]["grad_norm"] = float("inf")  # finite loss, inf grad norm: the loss scaler skipped the step
    findings = diagnose(records, MonitorSettings(precision="fp16"))
    assert "fp16_overflow" in kinds(findings) and not kinds(findings, ERROR)


def test_is_spike_robust_score() -> None:
    s = MonitorSettings()
    rng = random.Random(1)
    window = [3.0 + 0.05 * rng.gauss(0, 1) for _ in range(30)]
    assert is_spike(window, 6.0, s)
    assert not is_spike(window, 3.1, s)
    assert not is_spike(window, 0.5, s)  # downward moves are progress, never spikes
    assert not is_spike(window[:3], 60.0, s)  # too little history to judge
    assert is_spike(window, float("nan"), s)
    assert not is_spike([2.0] * 30, 2.01, s)  # a flat window must not make every wiggle a spike
    assert is_spike([*window, float("nan")], 6.0, s)  # non-finite history is ignored


def test_loss_and_grad_norm_spikes_are_found_at_their_step() -> None:
    records = history()
    train = [r for r in records if r["event"] == "train"]
    train[20]["loss"] *= 3
    train[12]["grad_norm"] = 40.0
    findings = diagnose(records, MonitorSettings())
    by_kind = {f.kind: f for f in findings}
    assert by_kind["loss_spike"].step == train[20]["step"] and by_kind["loss_spike"].severity == "warning"
    assert by_kind["grad_norm_spike"].step == train[12]["step"]
    assert not kinds(findings, ERROR)


def test_divergence_is_an_error() -> None:
    records = history(loss=lambda s: healthy_loss(s) if s < 150 else 7.5)
    found = [f for f in diagnose(records, MonitorSettings()) if f.kind == "divergence"]
    assert found and found[0].severity == ERROR and 150 <= found[0].step <= 170


def short_diverged_run() -> list[dict]:
    """Six steps at lr=10 as a tester logged them: the loss from 9 to ~8,900, every step after the first skipped."""
    losses = [9.0, 850.0, 4100.0, 8900.0, 8800.0, 8900.0]
    return [{"event": "train", "step": step, "loss": loss, "grad_norm": 1e4, "skipped_steps": step - 1}
            for step, loss in enumerate(losses, start=1)]


@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp16"])
def test_a_short_run_whose_loss_rose_by_orders_of_magnitude_diverged(precision: str) -> None:
    found = {f.kind: f for f in diagnose(short_diverged_run(), MonitorSettings(precision=precision, lr=10.0))}
    assert found["divergence"].severity == ERROR and found["divergence"].step == 2
    assert "9 (step 1) to 8.9e+03" in found["divergence"].message
    assert "Lower the lr" in found["divergence"].advice and "warm up" in found["divergence"].advice
    assert found["skipped_steps"].severity == ERROR and found["skipped_steps"].step == 3
    assert "5 of 6 steps were skipped" in found["skipped_steps"].message
    assert "clipping" in found["skipped_steps"].advice and "lower the lr" in found["skipped_steps"].advice


def test_the_advice_quotes_the_lr_the_rollbacks_left() -> None:
    """Two rollbacks halved the lr: "lower the lr" starts from what the run goes on at, not the configured one."""
    rollbacks = [{"event": "rollback", "step": 2, "to_step": 0, "lr_scale": 0.5},
                 {"event": "rollback", "step": 2, "to_step": 0, "lr_scale": 0.25}]
    found = {f.kind: f for f in diagnose([*rollbacks, *short_diverged_run()], MonitorSettings(lr=4e-4))}
    assert "now 1e-04; try 3.33e-05" in found["divergence"].advice, found["divergence"].advice
    damaged = {**rollbacks[1], "lr_scale": "x"}
    assert "now 4e-04" in diagnose([damaged, *short_diverged_run()], MonitorSettings(lr=4e-4))[0].advice


def test_a_short_healthy_run_and_a_few_skipped_steps_are_no_error() -> None:
    records = [{"event": "train", "step": step, "loss": 9.0 - step / 2, "grad_norm": 1.0, "skipped_steps": 1}
               for step in range(1, 7)]
    assert not kinds(diagnose(records, MonitorSettings()), ERROR)
    assert "fp16_skipped_steps" in kinds(diagnose(records, MonitorSettings(precision="fp16")), "warning")


def test_oscillation_found_and_advises_lower_lr() -> None:
    records = history(loss=lambda s: 4.0 + (0.8 if (s // 10) % 2 else -0.8), noise=0.01)
    found = [f for f in diagnose(records, MonitorSettings(lr=1e-3)) if f.kind == "oscillation"]
    assert found and found[0].severity == "warning" and "lr" in found[0].advice and "batch" in found[0].advice


def test_plateau_from_the_start_advises_raising_lr_10x() -> None:
    records = history(loss=lambda s: 9.0, eval_loss=lambda s: 9.0)
    found = {f.kind: f for f in diagnose(records, MonitorSettings(lr=1e-5))}
    assert "plateau" in found and "1e-04" in found["plateau"].advice and "10x" in found["plateau"].advice
    assert "oscillation" not in found


def test_eval_plateau_is_info() -> None:
    records = history(num_steps=800, eval_loss=lambda s: max(healthy_loss(s), 2.5) + 0.1, noise=0.008)
    found = [f for f in diagnose(records, MonitorSettings()) if f.kind == "eval_plateau"]
    assert found and found[0].severity == "info"


def test_the_eval_a_rollback_to_step_0_reruns_counts_once() -> None:
    """Three rollbacks to step 0 logged its eval four times: "not improved for 3 evals since step 0" at step 0."""
    records = [{"event": "eval", "step": 0, "eval_loss": 6.25}]
    for _ in range(3):
        records += [{"event": "train", "step": 1, "loss": 9.0}, {"event": "rollback", "step": 1, "to_step": 0},
                    {"event": "eval", "step": 0, "eval_loss": 6.25}]
    assert not [f for f in diagnose(records, MonitorSettings()) if f.kind == "eval_plateau"]  # (the live check)


@pytest.mark.parametrize(("began", "rise", "severity"), [(400, 0.004, ERROR), (600, 0.0003, "warning")])
def test_overfitting_names_the_step_it_began(began: int, rise: float, severity: str) -> None:
    def eval_loss(step: int) -> float:
        return healthy_loss(min(step, began)) + 0.3 + rise * max(step - began, 0)

    records = history(num_steps=1000, eval_loss=eval_loss)
    found = [f for f in diagnose(records, MonitorSettings()) if f.kind == "overfitting"]
    assert len(found) == 1 and found[0].severity == severity
    assert abs(found[0].step - began) <= 100  # within one eval interval of the planted start
    assert "dropout" in found[0].advice and "early" in found[0].advice.lower()


def test_no_overfitting_when_train_loss_rises_too() -> None:
    records = history(num_steps=600, loss=lambda s: healthy_loss(min(s, 300)) + 0.004 * max(s - 300, 0))
    assert "overfitting" not in kinds(diagnose(records, MonitorSettings()))


def test_grad_norm_outside_band_is_never_an_error() -> None:
    low = diagnose(history(grad_norm=lambda s: 0.2), MonitorSettings())
    assert {f.severity for f in low if f.kind == "grad_norm_low"} == {"info"}
    high = diagnose(history(grad_norm=lambda s: 5.0), MonitorSettings(max_grad_norm=0.0))
    found = [f for f in high if f.kind == "grad_norm_high"]
    assert found and found[0].severity == "warning" and "max_grad_norm=1.0" in found[0].advice
    assert not kinds(low + high, ERROR)


def test_perplexity_ranges_depend_on_run_kind() -> None:
    records = history(loss=lambda s: 7.0, eval_loss=lambda s: 7.0)  # ppl ~ 1100
    assert "ppl_range" in kinds(diagnose(records, MonitorSettings(run_kind="pretrain")), "info")
    assert "ppl_range" in kinds(diagnose(records, MonitorSettings(run_kind="finetune")), "warning")
    fine = history(loss=lambda s: 1.5, eval_loss=lambda s: 1.5)  # ppl ~ 4.5: fine for either kind
    assert "ppl_range" not in kinds(diagnose(fine, MonitorSettings(run_kind="finetune")))


def test_rolled_back_records_do_not_count_as_history() -> None:
    records = history(num_steps=200)
    # Steps 110-150 were logged, then the trainer rolled back to 100 and relogged them healthy.
    bad = [{"event": "train", "step": s, "loss": 8.0, "grad_norm": 1.0} for s in range(110, 160, 10)]
    cut = next(i for i, r in enumerate(records) if r["step"] > 100)
    records[cut:cut] = [*bad, {"event": "rollback", "step": 150, "to_step": 100}]
    found = diagnose(records, MonitorSettings())
    assert "divergence" not in kinds(found)
    assert "loss_spike" in kinds(found)  # the spike itself still happened and is reported


def test_settings_from_config() -> None:
    cfg = {"model": {"name_or_path": "meta-llama/Llama-2-7b-hf"}, "train": {"max_grad_norm": 0.0},
           "precision": {"name": "fp16"}, "lr": "auto"}
    s = settings_from_config(cfg, lr=2e-4)
    assert (s.run_kind, s.max_grad_norm, s.precision, s.lr) == ("finetune", 0.0, "fp16", 2e-4)
    assert settings_from_config({"lr": 1e-3}).run_kind == "pretrain"


@pytest.mark.parametrize("clip", ["abc", [1, 2], {"a": 1}])
def test_settings_from_an_edited_config_fall_back_to_the_default(clip: object) -> None:
    """A saved config whose value has the wrong type (an edited `.hydra/config.yaml`) is read as the schema's
    default, as for a missing key; the doctor and the reports raised ValueError or TypeError on it."""
    assert settings_from_config({"train": {"max_grad_norm": clip}}).max_grad_norm == 1.0


def test_finding_steps_are_stable_as_the_history_grows() -> None:
    """The trainer logs each finding once, keyed by kind and step: a persisting condition must keep its step."""
    records = history(num_steps=1000, grad_norm=lambda s: 0.2, loss=lambda s: 7.0, eval_loss=lambda s: 7.0,
                      noise=0.004)
    steps: dict[str, set[int]] = {}
    for end in range(400, 1001, 100):
        for f in diagnose([r for r in records if r["step"] <= end], MonitorSettings()):
            steps.setdefault(f.kind, set()).add(f.step)
    assert {"grad_norm_low", "ppl_range", "plateau"} <= steps.keys()
    assert all(len(s) == 1 for s in steps.values()), steps


def test_a_run_the_trainer_stopped_is_an_error() -> None:
    records = [*history(num_steps=20),
               {"event": "anomaly", "step": 21, "loss": 549.0, "grad_norm": 1590.0, "policy": "stop",
                "action": "diverged"}]
    found = {f.kind: f for f in diagnose(records, MonitorSettings(lr=10.0))}
    assert found["divergence"].severity == ERROR and found["divergence"].step == 21
    assert "lr=auto" in found["divergence"].advice
    assert found["loss_spike"].severity == "warning"


def test_grad_norm_noise_is_not_a_spike() -> None:
    """Real tiny-model grad norms (a clean run) jump 2x between steps; only a 3x jump is a spike."""
    norms = [1.08, 1.15, 1.29, 1.13, 1.56, 0.99, 0.94, 1.05, 1.05, 0.81, 0.82, 1.04, 0.74, 1.42, 0.92, 0.87, 0.83,
             1.0, 0.8, 0.72, 0.75, 1.19, 1.0, 0.79, 0.87, 0.87, 0.81, 1.03, 0.79, 0.68, 0.89, 0.73, 1.01, 0.81, 1.74]
    records = [{"event": "train", "step": 5 * (i + 1), "loss": 6.0 - 0.01 * i, "grad_norm": g}
               for i, g in enumerate(norms)]
    assert "grad_norm_spike" not in kinds(diagnose(records, MonitorSettings()))
    records.append({"event": "train", "step": 5 * (len(norms) + 1), "loss": 5.6, "grad_norm": 4.0})
    assert "grad_norm_spike" in kinds(diagnose(records, MonitorSettings()))


def test_a_slow_steady_fall_is_not_a_plateau() -> None:
    """A real tiny-model run (logging every step): 6.27 -> 5.92 in 60 steps, 5% but far above the noise."""
    losses = [6.27, 6.27, 6.25, 6.24, 6.23, 6.2, 6.21, 6.22, 6.24, 6.18, 6.21, 6.21, 6.18, 6.19, 6.17, 6.19, 6.17,
              6.13, 6.14, 6.14, 6.14, 6.08, 6.08, 6.08, 6.06, 6.07, 6.07, 6.04, 6.06, 6.03, 6.02, 6.0, 6.0, 6.03,
              5.97, 6.02, 5.98, 5.96, 5.98, 5.94, 5.95, 5.96, 5.94, 6.0, 5.94, 5.98, 5.97, 5.96, 5.92, 5.96, 5.92,
              5.94, 5.91, 5.96, 5.91, 5.91, 5.91, 5.93, 5.97, 5.92]
    records = [{"event": "train", "step": i + 1, "loss": v, "grad_norm": 1.0} for i, v in enumerate(losses)]
    for end in range(20, 61, 10):  # as the trainer sees it live, at every prefix
        assert not diagnose(records[:end], MonitorSettings()), end
    stuck = [{**r, "loss": 6.24 + 0.02 * ((r["step"] * 7) % 5 - 2) / 2} for r in records]
    assert "plateau" in kinds(diagnose(stuck, MonitorSettings()))


def live(records: list[dict], settings: MonitorSettings) -> list[dict]:
    """The history as the trainer writes it: after each eval it diagnoses the history so far and logs each
    new finding once (`train.anomaly.report_findings`), which the console prints."""
    out: list[dict] = []
    seen: set[tuple[str, int, str]] = set()
    for rec in records:
        out.append(rec)
        if rec["event"] == "eval":
            for f in diagnose(out, settings):
                if (f.kind, f.step, f.severity) not in seen:
                    seen.add((f.kind, f.step, f.severity))
                    out.append({"event": "finding", **f.to_dict()})
    return out


def test_a_printed_finding_that_stopped_holding_is_kept_as_resolved() -> None:
    """The console printed 'eval perplexity ... far above' at step 100; the perplexity then came down.
    summary.json (reconcile) keeps the finding, resolved at the first eval that no longer held it."""
    settings = MonitorSettings()
    records = live(history(num_steps=400, eval_loss=lambda s: 6.5 if s <= 100 else 3.0), settings)
    printed = [r for r in records if r["event"] == "finding" and r["kind"] == "ppl_range"]
    assert printed and printed[0]["step"] == 100
    assert "ppl_range" not in kinds(diagnose(records, settings))  # the final diagnosis alone would drop it
    (kept,) = [f for f in reconcile(records, settings) if f["kind"] == "ppl_range"]
    assert (kept["status"], kept["resolved_at"], kept["step"]) == ("resolved", 200, 100)
    assert kept["message"] == printed[0]["message"]
    assert worst_severity([kept]) is None  # a resolved finding no longer counts


def test_every_printed_finding_is_in_the_reconciled_list() -> None:
    settings = MonitorSettings()
    records = live(history(num_steps=600, loss=lambda s: 7.0, eval_loss=lambda s: 7.0 if s < 300 else 2.5,
                           grad_norm=lambda s: 0.2, noise=0.004), settings)
    printed = {(r["kind"], r["step"], r["severity"]) for r in records if r["event"] == "finding"}
    reconciled = reconcile(records, settings)
    assert printed and printed <= {(f["kind"], f["step"], f["severity"]) for f in reconciled}
    assert all(f["status"] in ("open", "resolved", "superseded") for f in reconciled)
    assert {f["kind"] for f in reconciled if f["status"] == "open"} == kinds(diagnose(records, settings))


def test_setup_facts_become_findings_said_once() -> None:
    """The trainer's `start` record says bf16 is emulated and the MFU ceiling was not trusted."""
    start = {"event": "start", "step": 0, "device": "cpu", "bf16_emulated": "precision=bf16 ... emulated",
             "bf16_advice": "Use precision=auto", "mfu_note": "the ceiling was measured on shared cores"}
    records = [start, *history(num_steps=100)]
    found = {f.kind: f for f in diagnose(records, MonitorSettings())}
    assert found["bf16_emulated"].severity == "warning" and "precision=auto" in found["bf16_emulated"].advice
    assert found["mfu_unavailable"].severity == "info" and "shared cores" in found["mfu_unavailable"].message
    assert not {"bf16_emulated", "mfu_unavailable"} & kinds(diagnose(history(num_steps=100), MonitorSettings()))


def test_an_implausible_cpu_mfu_is_flagged() -> None:
    records = [{"event": "start", "step": 0, "device": "cpu"},
               *[{**r, "mfu": 0.87 if r["step"] == 50 else 0.3} for r in history(num_steps=100)]]
    (f,) = [f for f in diagnose(records, MonitorSettings()) if f.kind == "mfu_implausible"]
    assert f.step == 50 and "87%" in f.message
    records[0]["device"] = "cuda"  # a GPU step can reach a high share of its matmul ceiling
    assert "mfu_implausible" not in kinds(diagnose(records, MonitorSettings()))
