"""Health detectors: pure functions of the metric history, with the seed's advice attached.

`diagnose(records, settings)` reads the records of `metrics.jsonl` (see the run-directory
contract) and returns every finding over the whole history. The trainer calls it live and
`python -m llmexp.doctor` calls it after the fact, so both see the same verdicts.
`is_spike` is the O(window) test the trainer runs before each optimizer step.

Severities are calibrated so that a healthy run yields nothing of `error` severity:
error = the run is broken (non-finite values, divergence, clear overfitting); warning = it
works but something should change; info = worth knowing. No torch and no numpy here.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from llmexp.rundir.read import config_value

INFO, WARNING, ERROR = "info", "warning", "error"
_MAD_TO_STD = 1.4826  # scales the median absolute deviation to a standard deviation for normal data


@dataclass(frozen=True)
class Finding:
    """One verdict about a run: what, where, how bad, and what to do about it."""

    kind: str
    step: int
    severity: str
    message: str
    advice: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(value: Any) -> float:
    """A metric as a float; missing or null values (how some writers encode NaN) become NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _step_noise(values: list[float]) -> float:
    """The noise of a series alone, trend removed: the MAD of its successive differences / sqrt(2)."""
    diffs = [b - a for a, b in itertools.pairwise(values)]
    centre = statistics.median(diffs)
    return statistics.median(abs(d - centre) for d in diffs) * _MAD_TO_STD / math.sqrt(2)


def _robust_z(window: list[float], value: float) -> tuple[float, float]:
    """(z-score of value against window, the window median).

    Centre: the median. Scale: the smaller of the MAD of the values and the MAD of their
    successive differences / sqrt(2). The second is the noise alone even while the loss is
    falling fast, where the spread of the values is mostly trend and would hide a spike.
    """
    median = statistics.median(window)
    mad = statistics.median(abs(v - median) for v in window) * _MAD_TO_STD
    if len(window) >= 3:
        mad = min(mad, _step_noise(window))
    floor = 1e-3 * abs(median) + 1e-12  # a flat window must not make every wiggle infinite
    return (value - median) / max(mad, floor), median


def is_spike(values: list[float], value: float, settings: MonitorSettings) -> bool:
    """Whether `value` jumps far above the trailing `settings.window` of `values`.

    A non-finite value is always a spike. Non-finite history values are ignored. Only upward
    jumps count, and only once `settings.min_history` finite values are there.
    """
    if not math.isfinite(value):
        return True
    window = [v for v in values[-settings.window:] if math.isfinite(v)]
    if len(window) < settings.min_history:
        return False
    z, median = _robust_z(window, value)
    return z > settings.spike_z and value - median > settings.spike_min_rel * abs(median)


# ----- history preparation -------------------------------------------------------------------

def _effective(records: list[dict]) -> list[dict]:
    """The history as the model lived it: after a resume or rollback to step s, the records
    logged earlier at steps > s were discarded work and are dropped, and a step logged again (the eval at s, rerun
    after a rollback to s) counts once, as last logged."""
    kept: list[dict] = []
    for rec in records:
        if rec.get("event") in ("resume", "rollback"):
            to_step = int(rec.get("to_step", rec.get("step", 0)))
            kept = [r for r in kept if int(r.get("step", 0)) <= to_step or r.get("event") not in ("train", "eval")]
        kept.append(rec)
    logged = ("train", "eval")
    last = {(r["event"], r.get("step")): i for i, r in enumerate(kept) if r.get("event") in logged}
    return [r for i, r in enumerate(kept) if r.get("event") not in logged or last[(r["event"], r.get("step"))] == i]


def _series(records: Iterable[dict], event: str, key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), _num(r.get(key))) for r in records if r.get("event") == event and key in r]


class _History:
    """What the detectors read: the records as logged, the live ones (`_effective`), and the finite
    (step, value) points of the live train loss, eval loss, grad norm and eval perplexity."""

    def __init__(self, records: list[dict]) -> None:
        self.records, self.live = records, _effective(records)
        self.train, self.evals, self.grad_norm, self.eval_ppl = (
            [(s, v) for s, v in _series(self.live, event, key) if math.isfinite(v)]
            for event, key in (("train", "loss"), ("eval", "eval_loss"), ("train", "grad_norm"), ("eval", "eval_ppl")))


def _fmt(x: float) -> str:
    """A learning rate as people write it: 1e-04, 3.3e-04."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _lower_lr(lr: float) -> str:
    """The 'lower the lr' clause: a third of it, or the seed's table when it is absurd."""
    if lr >= 1e-2:
        return f"lower the lr (now {_fmt(lr)}: far above what LLMs train at; lr=auto picks from the model size)"
    return f"lower the lr (now {_fmt(lr)}; try {_fmt(lr / 3)})"


def _nan_advice(settings: MonitorSettings) -> str:
    if settings.max_grad_norm <= 0:
        clip = "Turn gradient clipping on (train.max_grad_norm=1.0; 0.5 if it keeps exploding)"
    else:
        clip = f"Check that clipping is working (train.max_grad_norm={settings.max_grad_norm:g}; try 0.5)"
    fp16 = ["switch FP16 to BF16 (precision=bf16) if the hardware has it"] if settings.precision == "fp16" else []
    return "; ".join([clip, *fp16, _lower_lr(settings.lr), "check the data for abnormal or empty examples"]) + "."


# ----- detectors: each yields its findings about a history -----------------------------------

def _non_finite(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    bad: list[tuple[int, str]] = []
    scaler_overflows = 0
    for rec in h.records:
        if rec.get("event") not in ("train", "anomaly"):
            continue
        loss, gnorm = _num(rec.get("loss", 0.0)), _num(rec.get("grad_norm", 0.0))
        if math.isfinite(loss) and not math.isfinite(gnorm) and settings.precision == "fp16":
            scaler_overflows += 1  # the fp16 loss scaler overflowed and skipped the step: by design
            continue
        if what := [name for name, v in (("loss", loss), ("grad norm", gnorm)) if not math.isfinite(v)]:
            bad.append((int(rec["step"]), " and ".join(what)))
    if bad:
        first_step, what = bad[0]
        steps = sorted({s for s, _ in bad})
        yield Finding("non_finite", first_step, ERROR,
                      f"non-finite {what} at step {first_step} ({len(steps)} step(s) affected, "
                      f"last at {steps[-1]}): gradients exploded",
                      _nan_advice(settings))
    if scaler_overflows:
        yield Finding("fp16_overflow", 0, INFO,
                      f"{scaler_overflows} logged step(s) had an infinite grad norm with a finite loss: "
                      "the fp16 loss scaler skipped them", "Nothing to do unless it is frequent; "
                      "BF16 (precision=bf16) avoids loss scaling altogether.")


def _spikes(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    grad_settings = replace(settings, spike_min_rel=settings.grad_spike_min_rel)
    for key, label, judge in (("loss", "loss", settings), ("grad_norm", "grad norm", grad_settings)):
        history: list[float] = []
        spikes = []
        for step, value in _series(h.records, "train", key):
            if math.isfinite(value) and is_spike(history, value, judge):
                _, median = _robust_z([v for v in history[-settings.window:] if math.isfinite(v)], value)
                spikes.append((step, value, median))
            history.append(value)
        for rec in h.records:  # finite anomalies are spikes the trainer caught live, maybe never logged
            finite = all(math.isfinite(_num(rec.get(k, 0.0))) for k in ("loss", "grad_norm"))
            if rec.get("event") == "anomaly" and finite and rec.get("metric", "loss") == key:
                spikes.append((int(rec["step"]), _num(rec.get(key)), math.nan))
        if spikes:
            step, value, median = min(spikes)
            base = f" (trailing median {median:.3g})" if math.isfinite(median) else ""
            yield Finding(f"{key}_spike", step, WARNING,
                          f"{label} spiked to {value:.3g} at step {step}{base}; {len(spikes)} spike(s) in all",
                          f"{_cap(_lower_lr(settings.lr))}, or raise the batch size / "
                          "gradient accumulation; check that clipping is on; check the data near this step.")


def _divergence(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    """The trainer gave up on the run (an anomaly it could not skip or roll back), or the loss climbed
    back up and stayed there."""
    for rec in h.records:
        if rec.get("event") == "anomaly" and rec.get("action") == "diverged":
            loss, gnorm = _num(rec.get("loss")), _num(rec.get("grad_norm"))
            yield Finding("divergence", int(rec["step"]), ERROR,
                          f"training diverged at step {rec['step']} (loss {loss:.4g}, grad norm {gnorm:.4g}); "
                          f"the on_anomaly policy ({rec.get('policy', '?')}) ended the run",
                          _nan_advice(settings))
            return
    train = h.train
    first, last = (train[0][1], train[-1][1]) if train else (0.0, 0.0)
    if last > settings.diverge_factor * first and last - first > settings.diverge_min_nats:
        # orders of magnitude up, judged on any number of points: a few steps at an absurd lr are enough
        began = _streak_start(train, lambda v: v > settings.diverge_factor * first)
        yield Finding("divergence", began, ERROR,
                      f"the loss rose from {first:.3g} (step {train[0][0]}) to {last:.3g} (step {train[-1][0]}), "
                      f"over {settings.diverge_factor:g}x: training diverged",
                      f"{_cap(_lower_lr(settings.lr))}; warm up longer (train.warmup_steps); "
                      "check that clipping is on.")
        return
    if len(train) < settings.min_history * 2:
        return
    recent = statistics.median(v for _, v in train[-settings.min_history:])
    first = statistics.median(v for _, v in train[:3])
    low_step, low = min(train[:-settings.min_history], key=lambda sv: sv[1])
    drop = max(first - low, 0.0)
    rise = recent - low
    if rise > settings.diverge_min_nats and rise > settings.diverge_rel * drop:
        began = next(s for s, v in train if s > low_step and v > low + rise / 2)
        yield Finding("divergence", began, ERROR,
                      f"the loss climbed back from {low:.3g} (step {low_step}) to {recent:.3g} and stayed there",
                      f"{_cap(_lower_lr(settings.lr))}, or raise the batch size; "
                      "check that clipping is on; resume from a checkpoint before this step.")


def _linear_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(slope, robust residual std) of a least-squares line through points."""
    xs = [float(s) for s, _ in points]
    ys = [v for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys, strict=True)]
    centre = statistics.median(resid)
    return slope, statistics.median(abs(r - centre) for r in resid) * _MAD_TO_STD


def _oscillation(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    w = settings.window
    hits = []
    for start in range(0, len(h.train) - w + 1, max(w // 2, 1)):
        chunk = h.train[start:start + w]
        slope, std = _linear_fit(chunk)  # std: robust (MAD) spread of the residuals, so one spike is not a swing
        level = statistics.median(v for _, v in chunk)
        trend_drop = -slope * (chunk[-1][0] - chunk[0][0])
        if std > settings.oscillation_rel_std * abs(level) and trend_drop < settings.oscillation_trend_ratio * std:
            hits.append((chunk[0][0], std, level))
    if hits:
        step, std, level = hits[0]
        yield Finding("oscillation", step, WARNING,
                      f"the loss swings by ±{std:.3g} around {level:.3g} without falling "
                      f"(from step {step}; {len(hits)} window(s))",
                      f"The lr is probably too large (now {_fmt(settings.lr)}; try {_fmt(settings.lr / 3)}) or the "
                      "batch too small: raise batch_size or train.gradient_accumulation_steps.")


def _plateau(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    if len(h.train) < settings.plateau_min_records:
        return
    k = max(3, len(h.train) // 4)
    values = [v for _, v in h.train]
    first, last = statistics.median(values[:k]), statistics.median(values[-k:])
    # The drop must also be lost in the noise: a tiny model's slow but steady fall is not a plateau.
    stderr = 1.25 * _step_noise(values) * math.sqrt(2 / k)  # of a difference of two medians of k values
    if first - last < settings.plateau_min_drop * abs(first) and first - last <= 3 * stderr + 1e-12:
        yield Finding("plateau", h.train[0][0], WARNING,
                      f"the loss never fell: {first:.3g} at the start, {last:.3g} at the end",
                      f"The lr may be too small: raise it 10x (lr={_fmt(settings.lr * 10)}); check that the "
                      "data loads correctly (look at a few decoded examples); check that the loss "
                      "matches the task.")


def _eval_plateau(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    evals = h.evals
    if len(evals) <= settings.plateau_evals:
        return
    best_i, best = 0, evals[0][1]
    for i, (_, v) in enumerate(evals[1:], start=1):
        if v < best * (1 - settings.min_delta):
            best_i, best = i, v
    after = evals[best_i + 1:]
    rising = any(v > best * (1 + settings.overfit_warn_rise) for _, v in after)  # overfitting's business
    if len(after) >= settings.plateau_evals and not rising:
        yield Finding("eval_plateau", evals[best_i][0], INFO,
                      f"the eval loss has not improved for {len(after)} evals since step "
                      f"{evals[best_i][0]} (best {best:.4g})",
                      "Training has converged at this lr: stop early "
                      "(train.early_stopping_patience), or lower the lr / add data to go further.")


def _overfitting(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    evals = h.evals
    if len(evals) < settings.overfit_min_evals + 2:
        return
    best_i = min(range(len(evals)), key=lambda i: evals[i][1])
    best_step, best = evals[best_i]
    after = evals[best_i + 1:]
    threshold = best * (1 + settings.overfit_warn_rise)
    recent = after[-settings.overfit_min_evals:]
    if len(after) < settings.overfit_min_evals or not all(v > threshold for _, v in recent):
        return
    margin = max(1, (after[-1][0] - best_step) // 10)
    near = [v for s, v in h.train if abs(s - best_step) <= margin]
    later = [v for s, v in h.train if s >= after[-1][0] - margin]
    if not near or not later or statistics.median(later) >= statistics.median(near):
        return  # train loss did not fall: that is divergence or a plateau, not overfitting
    rise = after[-1][1] / best - 1
    yield Finding("overfitting", best_step, ERROR if rise >= settings.overfit_error_rise else WARNING,
                  f"the eval loss rose {rise:.1%} above its best ({best:.4g} at step {best_step}) to "
                  f"{after[-1][1]:.4g} while the train loss kept falling: overfitting began at step {best_step}",
                  "Stop early (train.early_stopping_patience=2 keeps the best checkpoint), train fewer steps, "
                  "lower the lr, add dropout (model.attention_dropout=0.1) or add data.")


def _streak_start(points: list[tuple[int, float]], outside: Callable[[float], bool]) -> int:
    """The step where the trailing run of `outside` values began (the first such step if the last is not).
    Stable while the condition persists, so the trainer's live findings (keyed by kind and step) do not repeat."""
    start = None
    for step, value in reversed(points):
        if not outside(value):
            break
        start = step
    return start if start is not None else next((s for s, v in points if outside(v)), points[0][0])


def _grad_band(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    half = h.grad_norm[len(h.grad_norm) // 2:]
    if len(half) < settings.min_history:
        return
    low, high = settings.grad_band
    median = statistics.median(v for _, v in half)
    above = sum(v > high for _, v in half) / len(half)
    below = sum(v < low for _, v in half) / len(half)
    step = _streak_start(h.grad_norm, lambda v: not low <= v <= high)
    if above >= settings.grad_band_fraction:
        clip = ("clipping is off: turn it on (train.max_grad_norm=1.0)" if settings.max_grad_norm <= 0 else
                f"clipping at {settings.max_grad_norm:g} is rescaling most steps")
        yield Finding("grad_norm_high", step, WARNING,
                      f"grad norm above {high:g} on {above:.0%} of the second half of the run (median {median:.3g})",
                      f"{clip}; if the loss is also noisy, lower the lr (now {_fmt(settings.lr)}).")
    elif below >= settings.grad_band_fraction:
        yield Finding("grad_norm_low", step, INFO,
                      f"grad norm below {low:g} on {below:.0%} of the second half of the run (median {median:.3g})",
                      "Often fine for small models late in training; if the loss has stalled too, raise the lr.")


def _perplexity(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    if len(h.eval_ppl) < 2:  # the step-0 eval alone says nothing about training
        return
    ppl = h.eval_ppl[-1][1]
    f = settings.ppl_far_factor
    low, high = settings.pretrain_ppl
    too_high = high * f if settings.run_kind == "pretrain" else settings.finetune_ppl_max * f
    out_of_range = (lambda v: v > too_high) if ppl > too_high else (lambda v: v < low / f)
    step = _streak_start(h.eval_ppl[1:], out_of_range)
    if ppl > too_high and settings.run_kind == "finetune":
        yield Finding("ppl_range", step, WARNING,
                      f"eval perplexity {ppl:.4g} is far above what a fine-tuned model reaches "
                      f"(lower is better; > {too_high:g} is suspicious)",
                      "Check that the tokenizer and chat template match the model and that the data "
                      "loads correctly; check the lr is not too high.")
    elif ppl > too_high:
        yield Finding("ppl_range", step, INFO,
                      f"eval perplexity {ppl:.4g} is far above the typical pretraining range {low:g}-{high:g}",
                      "The model has learned little yet: train longer; if the loss has stalled, raise the lr "
                      "10x or check the data.")
    elif ppl < low / f and settings.run_kind != "finetune":
        yield Finding("ppl_range", step, INFO,
                      f"eval perplexity {ppl:.4g} is far below the typical pretraining range {low:g}-{high:g}",
                      "Check that eval data does not overlap the training data and is not trivially "
                      "repetitive.")


def _skipped_steps(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    """Steps the optimizer skipped (non-finite gradients, or fp16's loss scaler): most of them, under any
    precision, means the run did not train; under fp16 a few more than usual are worth a warning."""
    counts = [(int(r["step"]), _num(r.get("skipped_steps", 0))) for r in h.live if r.get("event") == "train"]
    shares = [(step, skipped / step) for step, skipped in counts if step > 0 and math.isfinite(skipped)]
    if not shares:
        return
    step, share = shares[-1]
    what = (f"{round(share * step)} of {step} steps were skipped (spikes or non-finite gradients that "
            "train.on_anomaly skipped, or fp16 overflows)")
    if share > settings.skip_error_fraction:
        yield Finding("skipped_steps", _streak_start(shares, lambda v: v > settings.skip_error_fraction), ERROR,
                      f"{what}: the model barely trained", _nan_advice(settings))
    elif settings.precision == "fp16" and share > settings.fp16_skip_fraction:
        yield Finding("fp16_skipped_steps", _streak_start(shares, lambda v: v > settings.fp16_skip_fraction),
                      WARNING, what, "Switch FP16 to BF16 (precision=bf16) where the hardware has it; check "
                      "clipping is on; lower the lr.")


CPU_MFU_PLAUSIBLE = 0.85
"""On CPU, a whole training step above this share of the measured matmul ceiling is implausible: the step
also runs attention, norms, the loss and the optimizer, which reach far less than a large matmul does.
The best measured on an idle 2-core AVX512-BF16 CPU was 75% (the tiny model with torch.compile)."""


def _run_facts(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    """Facts the trainer recorded about the setup (`start` records) or learned while running (`mfu_note`
    on a train record): emulated bf16, and an MFU it will not report, each said once."""
    start = next((r for r in h.records if r.get("event") == "start" and r.get("bf16_emulated")), None)
    if start is not None:
        yield Finding("bf16_emulated", int(start["step"]), WARNING, str(start["bf16_emulated"]),
                      str(start.get("bf16_advice") or "Use precision=auto for the faster run."))
    noted = next((r for r in h.records if r.get("event") in ("start", "train") and r.get("mfu_note")), None)
    if noted is not None:
        yield Finding("mfu_unavailable", int(noted["step"]), INFO, f"MFU is not reported: {noted['mfu_note']}",
                      "Nothing is wrong with training. For an MFU, run once on an idle machine (the ceiling "
                      "is then measured and kept) or set train.peak_tflops.")


def _mfu_plausibility(h: _History, settings: MonitorSettings) -> Iterator[Finding]:
    """MFU above the CPU sanity bound: the ceiling it divides by was measured too low."""
    start = next((r for r in reversed(h.live) if r.get("event") == "start"), {})
    high = [(step, mfu) for step, mfu in _series(h.live, "train", "mfu") if mfu > CPU_MFU_PLAUSIBLE]
    if start.get("device") == "cpu" and high:
        step, value = high[0]
        yield Finding("mfu_implausible", step, WARNING,
                      f"MFU {value:.0%} at step {step} is implausible on a CPU (a training step reaches well under "
                      f"{CPU_MFU_PLAUSIBLE:.0%} of a large matmul's rate); {len(high)} logged step(s) above it",
                      "Do not compare this MFU across runs: the run measured its matmul ceiling again and it still "
                      "reads too low (busy cores). Run once on an idle machine (the higher ceiling is kept), or set "
                      "train.peak_tflops.")


_DETECTORS: tuple[Callable[[_History, MonitorSettings], Iterator[Finding]], ...] = (
    _non_finite, _spikes, _divergence, _oscillation, _plateau, _eval_plateau, _overfitting, _grad_band, _perplexity,
    _skipped_steps, _run_facts, _mfu_plausibility)


_SEVERITY_RANK = {INFO: 0, WARNING: 1, ERROR: 2}
DETECTOR_KINDS = frozenset({
    "non_finite", "fp16_overflow", "loss_spike", "grad_norm_spike", "divergence", "oscillation", "plateau",
    "eval_plateau", "overfitting", "grad_norm_high", "grad_norm_low", "ppl_range", "fp16_skipped_steps",
    "skipped_steps", "bf16_emulated", "mfu_unavailable", "mfu_implausible"})
"""Every kind `diagnose` can report; the trainer's own findings (e.g. about rollbacks) use other kinds."""


@dataclass(frozen=True)
class MonitorSettings:
    """Detector thresholds (their defaults) and the run facts that change the advice: set up once by the trainer
    (`train.setup`, from the typed config and what it resolved), and by the reports from a run's files
    (`settings_from_config`)."""

    run_kind: str = "pretrain"
    """pretrain or finetune (model.name_or_path set): perplexity ranges differ."""
    max_grad_norm: float = 1.0
    """The clipping threshold; 0 means clipping is off (and the advice says to turn it on)."""
    precision: str = "bf16"
    """bf16, fp16, fp32: under fp16 the NaN advice is to switch to bf16."""
    lr: float = 3e-4
    """Peak learning rate, quoted in the advice."""
    window: int = 20
    """Trailing values the spike score and the oscillation test look at."""
    min_history: int = 5
    """Values needed before a spike can be called."""
    spike_z: float = 6.0
    """Robust z-score (median/MAD) above which a value is a spike."""
    spike_min_rel: float = 0.25
    """A spike must also exceed the trailing median by this fraction of it (ignores tiny noisy series)."""
    grad_spike_min_rel: float = 2.0
    """Grad-norm spikes must exceed the trailing median by this fraction of it (3x): grad norms are heavy-tailed."""
    diverge_min_nats: float = 0.5
    """Divergence: the recent loss sits this far (nats) above the lowest loss so far ..."""
    diverge_rel: float = 0.5
    """... and at least this fraction of the drop achieved earlier has been given back."""
    diverge_factor: float = 10.0
    """Divergence however short the run: the last loss is this many times the first (and diverge_min_nats above)."""
    oscillation_rel_std: float = 0.1
    """Oscillation: detrended loss std above this fraction of the loss level ..."""
    oscillation_trend_ratio: float = 1.0
    """... while the trend drop over the window is below this multiple of that std."""
    plateau_min_records: int = 20
    """Train records needed before 'the loss never fell' can be said."""
    plateau_min_drop: float = 0.05
    """The loss 'never fell' when its drop (first vs last quarter) is below this fraction and within
    three standard errors of the noise."""
    plateau_evals: int = 3
    """Evals in a row without a new best that make an eval plateau."""
    min_delta: float = 0.005
    """Relative improvement of the eval loss that counts as improvement."""
    overfit_min_evals: int = 2
    """Evals after the best one, all above it, before overfitting is called."""
    overfit_warn_rise: float = 0.02
    """Relative rise of the eval loss above its best: warning."""
    overfit_error_rise: float = 0.10
    """Relative rise of the eval loss above its best: error."""
    grad_band: tuple[float, float] = (0.5, 2.0)
    """The seed's healthy grad-norm band."""
    grad_band_fraction: float = 0.8
    """Share of the second half of the run outside the band that makes it 'persistent'."""
    pretrain_ppl: tuple[float, float] = (10.0, 30.0)
    """The seed's typical pretraining perplexity range."""
    finetune_ppl_max: float = 30.0
    """Fine-tuning: lower is better; above this a pretrained model is doing badly."""
    ppl_far_factor: float = 10.0
    """How many times outside a range counts as 'far'."""
    fp16_skip_fraction: float = 0.05
    """fp16: share of steps skipped by the loss scaler above which to warn."""
    skip_error_fraction: float = 0.5
    """Any precision: share of steps skipped (non-finite gradients) above which the run is broken."""


def diagnose(records: list[dict], settings: MonitorSettings) -> list[Finding]:
    """Every finding over a whole metric history, ordered by step, the most severe first. The advice quotes the lr
    the run goes on at: after rollbacks, the configured one times the last rollback's `lr_scale`."""
    history = _History(records)
    scale = next((_num(r.get("lr_scale")) for r in reversed(records) if r.get("event") == "rollback"), 1.0)
    if 0 < scale < 1:  # (a damaged record: the configured lr)
        settings = replace(settings, lr=settings.lr * scale)
    found = [finding for detect in _DETECTORS for finding in detect(history, settings)]
    return sorted(found, key=lambda f: (f.step, -_SEVERITY_RANK[f.severity], f.kind))


def _key(f: Finding | dict) -> tuple[str, int, str]:
    """A finding's identity, as the trainer keys the findings it prints (kind, step, severity)."""
    if isinstance(f, Finding):
        return f.kind, f.step, f.severity
    return str(f.get("kind")), int(f.get("step", 0)), str(f.get("severity"))


def _stopped_at(records: list[dict], start: int, key: tuple[str, int, str], settings: MonitorSettings,
                memo: dict[int, set[tuple[str, int, str]]]) -> int:
    """The step of the first eval after record `start` whose diagnosis (what the trainer ran live) no
    longer held the finding `key`; the last step when only the final diagnosis dropped it.
    `memo` keeps each eval's diagnosis for the other findings."""
    for i in range(start + 1, len(records)):
        if records[i].get("event") != "eval":
            continue
        if i not in memo:
            memo[i] = {_key(f) for f in diagnose(records[:i + 1], settings)}
        if key not in memo[i]:
            return int(records[i]["step"])
    return max((int(r.get("step", 0)) for r in records), default=0)


def reconcile(records: list[dict], settings: MonitorSettings) -> list[dict]:
    """The run's findings as summary.json, report.md and the doctor show them: one truth with the console.
    Each `open`, `resolved` or `superseded`, with `resolved_at`: docs/explanation/doctor.md, below its table."""
    final = diagnose(records, settings)
    said = {_key(f) for f in final}  # and each printed finding once: its first `finding` record
    out = [{**f.to_dict(), "status": "open", "resolved_at": None} for f in final]
    memo: dict[int, set[tuple[str, int, str]]] = {}
    for index, rec in enumerate(records):
        if rec.get("event") != "finding" or (key := _key(rec)) in said:
            continue
        said.add(key)
        kind, step, _ = key
        superseded = any(f.kind == kind and f.step == step for f in final)
        out.append({"kind": kind, "step": step, "severity": key[2], "message": str(rec.get("message", "")),
                    "advice": str(rec.get("advice", "")), "status": "superseded" if superseded else "resolved",
                    "resolved_at": _stopped_at(records, index, key, settings, memo)})
    return sorted(out, key=lambda f: (f["step"], -_SEVERITY_RANK.get(f["severity"], 0), f["kind"]))


def is_open(f: Finding | dict) -> bool:
    """Whether a finding still holds at the end of the run (objects and older summaries: always)."""
    return isinstance(f, Finding) or f.get("status", "open") == "open"


def worst_severity(findings: Iterable[Finding | dict]) -> str | None:
    """The most severe severity among the open findings (objects or dicts), None when there are none."""
    ranks = [_SEVERITY_RANK.get(f["severity"] if isinstance(f, dict) else f.severity, 0) for f in findings
             if is_open(f)]
    return (INFO, WARNING, ERROR)[max(ranks)] if ranks else None


def settings_from_config(cfg: dict[str, Any], lr: float | None = None, precision: str | None = None) -> MonitorSettings:
    """MonitorSettings of a run from its saved config (`.hydra/config.yaml` as plain data), for the doctor and the
    reports after the fact. `lr` and `precision` are what the run resolved `auto` to (summary.json); a key the
    file lacks, or holds with the wrong type (an edited file), has the schema's default, as it had in the run."""
    from llmexp.config.keys import leaves, type_problem
    from llmexp.config.validation import parse_lr

    def saved(key: str) -> Any:
        value = config_value(cfg, key)
        return leaves()[key].default if value is None or type_problem(key, value) else value

    try:
        cfg_lr = parse_lr(saved("lr"))  # None for auto: the trainer resolved it; summary.json has the value
    except (TypeError, ValueError):
        cfg_lr = None  # find: the range test picked it, as summary.json says
    return MonitorSettings(run_kind="finetune" if saved("model.name_or_path") else "pretrain",
                           max_grad_norm=float(saved("train.max_grad_norm")),
                           precision=precision or str(saved("precision.name")),
                           lr=lr if lr is not None else (cfg_lr if cfg_lr is not None else MonitorSettings.lr))
