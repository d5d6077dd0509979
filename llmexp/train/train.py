"""The training loop, top to bottom.

    setup -> data -> model -> optimizer -> (resume) -> for each step:
        [eval] [samples] -> micro-batches (forward, backward) -> unscale -> grad norm + clip
        -> non-finite / spike check BEFORE the optimizer step -> optimizer.step() -> zero_grad
        -> [log] [save] [preempt?]
    -> final eval and samples -> model/ -> summary.json -> report

Everything that decides *what* to do lives in components: the schedule (`schedule.lr_at`), the
anomaly policy (`anomaly.judge_step`), the detectors (`monitor`), the sampler
(`TokenDataset.step_indices`), the step engine (`engine`: plain, DeepSpeed or FSDP), checkpoint I/O (`resume`,
`finish`). The loop only calls them in the right order.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from llmexp.config.derived import parse_batch_size
from llmexp.config.validation import is_lr_find
from llmexp.data import datasets as data_lib
from llmexp.data import stream as stream_lib
from llmexp.data.tokenizer import load_tokenizer
from llmexp.monitor.logger import safe_exp
from llmexp.rundir.tasks import metric_at
from llmexp.train import lr_find, samples
from llmexp.train.anomaly import judge_step, report_findings
from llmexp.train.autobatch import choose_batch_size
from llmexp.train.finish import finish_run
from llmexp.train.pruning import TrialPruning
from llmexp.train.resume import load_resume_state, rollback, save_state_checkpoint, saved_auto_batch
from llmexp.train.runtime import Runtime, setup_runtime
from llmexp.train.schedule import lr_at, warmup_steps_for
from llmexp.train.state import LoopState, Run
from llmexp.train.tasks import build_suite, read_task_files, run_tasks


@dataclass
class RunResult:
    """What `train` returns: the final status and the summary written to summary.json."""

    status: str
    step: int
    summary: dict[str, Any] = field(default_factory=dict)


def train(cfg: DictConfig) -> RunResult:
    """Train one run described by a composed, validated config. Writes the run directory.

    SIGTERM, SIGUSR2 and Ctrl-C are caught from the start: one during start-up stops the run
    at its first step boundary, before the loop, with status `preempted` and a summary."""
    from llmexp.train.preemption import PreemptionSignal

    with PreemptionSignal():  # the loop's rt.preemption() shares this one's flag
        return _train(cfg)


def _train(cfg: DictConfig) -> RunResult:
    """`train` inside its signal guard: build, resume, loop, finish."""
    task_files = read_task_files(cfg)  # before anything loads: a bad task file is exit 2 with nothing written
    rt = setup_runtime(cfg)
    tokenizer = load_tokenizer(cfg)
    build = stream_lib.build_stream_datasets if cfg.data.streaming else data_lib.build_datasets  # stream: uncached
    train_ds, eval_ds, data_stats = build(cfg, tokenizer)
    rt.data_fingerprint = str(data_stats["data_cache_key"])  # in each checkpoint: a resume on other data is caught
    if parse_batch_size(cfg.batch_size) is None:  # batch_size=auto, before anything reads the plan:
        # the choice the checkpoint holds, else the estimate's upper bound and a probe step
        saved = saved_auto_batch(cfg, rt.run_dir)
        rt.auto_batch = choose_batch_size(cfg, rt, len(tokenizer), len(train_ds), saved).record()
    found = lr_find.found_lr(cfg, rt, train_ds, len(tokenizer), forward_backward) if is_lr_find(cfg.lr) else None
    if found is not None and cfg.train.lr_find_only:
        return RunResult(status="completed", step=0, summary=found)
    cfg = lr_find.with_lr(cfg, found) if found is not None else cfg  # the range test left no trace: a fresh start
    suite = build_suite(cfg, tokenizer, task_files, rt.is_main)
    model, optimizer, peak_lr, lr_source = rt.build(cfg, len(tokenizer))
    lr_source = "find" if found is not None else lr_source
    max_steps = rt.plan.max_steps(len(train_ds))
    warmup = warmup_steps_for(max_steps, cfg.train.warmup_ratio, cfg.train.warmup_steps)
    log = rt.logger(max_steps)
    run = Run(cfg, rt, model, optimizer, log, peak_lr=peak_lr, lr_source=lr_source, train_data=train_ds)
    run.pruning = TrialPruning.for_job(cfg, rt.is_main)  # a search's trial reports its evals to the study
    run.tasks, run.tokenizer = suite, tokenizer
    run.state = state = load_resume_state(run) or LoopState()
    state.batch_size_auto = rt.auto_batch or {}  # checkpoints keep the choice
    train_ds.restore(state.data_state)  # a stream continues at its checkpoint's window; the cached data is stateless
    state.num_examples = len(train_ds)  # 0 for a stream: its length is unknown
    status = "completed"
    if cfg.train.on_anomaly == "rollback" and state.step == 0 and not save_state_checkpoint(run):
        status = "failed"  # the disk is full (reported); the start checkpoint is what a rollback goes back to
    log.log({"event": "start", "step": state.step, "lr_chosen": peak_lr, "lr_source": lr_source,
             "num_params": rt.num_params, "global_batch_size": rt.plan.global_batch,
             "gradient_accumulation_steps": rt.plan.accum, "precision": rt.precision, **rt.start_facts(max_steps),
             **data_stats})

    def schedule(step: int) -> float:
        s = cfg.scheduler
        return state.lr_scale * lr_at(step, name=s.name, peak_lr=peak_lr, max_steps=max_steps, warmup_steps=warmup,
                                      min_lr_ratio=s.min_lr_ratio, decay_ratio=s.decay_ratio)

    window, engine = rt.window, rt.engine
    with rt.preemption() as preempt:
        if rt.any_rank(preempt.requested):  # a signal during start-up: this is the first step boundary
            status = "preempted"
        while status == "completed" and state.step < max_steps:
            step = state.step
            due = step % cfg.train.eval_steps == 0 and state.last_eval_step != step
            if due and (stop := evaluate_and_record(run, eval_ds, step)):
                # pruned: stopped as a preemption stops, with a checkpoint (a search may resume it by hand)
                status = stop if stop == "early_stopped" or save_state_checkpoint(run) else "failed"
                break
            if samples.due(cfg.train, step, max_steps):
                samples.record(run, tokenizer, step)  # on a forked RNG: training is bitwise unchanged
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            window.begin()
            loss_sum, n_targets, n_tokens = forward_backward(rt, model, train_ds, state)
            grad_norm = engine.unscale_and_clip(model, optimizer, cfg.train.max_grad_norm)  # DeepSpeed steps here
            loss, grad_norm = torch.stack([rt.reduce_sum(loss_sum) / n_targets,
                                           grad_norm.float().reshape(())]).tolist()  # the step's one host sync
            # Non-finite or spiking: the policy decides BEFORE the weights change (DeepSpeed: after, see engine.py).
            verdict = judge_step(cfg.train, state, loss, grad_norm, fp16=rt.precision == "fp16",
                                 stepped=engine.steps_in_clip, settings=rt.monitor_settings, log=log)
            if verdict == "ok":
                if engine.scaler is not None:  # fp16: the scaler skips a step whose grads overflowed
                    state.skipped_steps += not engine.scaler_step(optimizer)
                else:
                    optimizer.step()  # under DeepSpeed Accelerate's no-op: the engine has stepped
            optimizer.zero_grad(set_to_none=True)
            if verdict == "diverged":
                status = "diverged"
                break
            if verdict == "rollback":
                rollback(run)
                continue
            if cfg.train.compile and not rt.compile_time_s:
                rt.compile_time_s = window.discard()  # the first step compiles: report it apart
            else:
                window.add(n_tokens)
            state.step += 1
            log.advance()
            if state.step % cfg.train.logging_steps == 0 or state.step == max_steps:
                log.log(rt.train_record(state, loss, grad_norm, optimizer, window))
            saved = bool(cfg.train.save_steps) and state.step % cfg.train.save_steps == 0 and state.step < max_steps
            if saved and not save_state_checkpoint(run):
                status = "failed"  # the disk is full (reported; the older checkpoints are kept)
                break
            if rt.any_rank(preempt.requested):  # every rank must agree: saving is collective
                status = "preempted" if saved or save_state_checkpoint(run) \
                    else "failed"
                break
        # Still inside the signal guard: a late SIGTERM only sets the flag, and the run finishes.
        if status in ("completed", "early_stopped") and state.last_eval_step != state.step:
            evaluate_and_record(run, eval_ds, state.step, may_stop=False)
        if status in ("completed", "early_stopped") and cfg.train.sample_prompts:
            samples.record(run, tokenizer, state.step)
        summary = finish_run(run, tokenizer, status)
    return RunResult(status=summary["status"], step=state.step, summary=summary)  # a full disk: failed


def forward_backward(rt: Runtime, model: torch.nn.Module, train_ds: data_lib.TokenDataset | stream_lib.StreamDataset,
                     state: LoopState) -> tuple[torch.Tensor, int, int]:
    """Forward and backward over every micro-batch of one global batch; returns (loss sum on this rank,
    target tokens of the global batch, tokens of the global batch).

    Each micro-batch's loss *sum* is divided by the target-token count of the whole global batch,
    so accumulation and world size do not change the loss (a mean of means would).
    """
    plan = rt.plan
    indices = train_ds.step_indices(rt.data_seed, state.step + state.data_offset, plan.global_batch)
    n_targets = max(1, train_ds.num_targets(indices))
    loss_sum = torch.zeros((), device=rt.device)
    n_tokens = 0
    for micro in range(plan.accum):
        batch_idx = data_lib.micro_batch(indices, rt.rank, plan.world, micro, plan.micro)
        batch = {k: v.to(rt.device, non_blocking=True) for k, v in train_ds.get_batch(batch_idx).items()}
        n_tokens += batch["input_ids"].numel()
        # DDP averages gradients over ranks, so scale by world / n_targets to get the global mean.
        sync = nullcontext() if micro == plan.accum - 1 else rt.engine.no_sync(model)
        with sync, rt.autocast():
            micro_sum = model(**batch)
        rt.engine.backward(micro_sum * (plan.world / n_targets))
        loss_sum += micro_sum.detach()
    return loss_sum, n_targets, n_tokens * plan.world


@torch.no_grad()
def evaluate(cfg: DictConfig, rt: Runtime, model: torch.nn.Module, eval_ds: data_lib.TokenDataset) -> float:
    """Mean loss per target token over a fixed slice of the eval set, summed across ranks."""
    model.eval()
    total_examples = len(eval_ds)
    if cfg.train.eval_batches > 0:
        total_examples = min(total_examples, cfg.train.eval_batches * rt.plan.micro * rt.plan.world)
    sums = torch.zeros(2, device=rt.device)
    stride = rt.plan.micro * rt.plan.world
    starts = list(range(rt.rank * rt.plan.micro, total_examples, stride))
    # FSDP: each forward all-gathers, so every rank runs as many; a rank out of examples repeats one, unsummed.
    rounds = -(-total_examples // stride) if rt.engine.collective_forward else len(starts)
    for i in range(rounds):
        start = starts[i] if i < len(starts) else 0
        idx = torch.arange(start, min(start + rt.plan.micro, total_examples)).numpy()
        batch = {k: v.to(rt.device) for k, v in eval_ds.get_batch(idx).items()}
        with rt.autocast():
            loss_sum = model(**batch).float()
        if i < len(starts):
            sums[0] += loss_sum
            sums[1] += eval_ds.num_targets(idx)
    model.train()
    loss_sum, count = rt.reduce_sum(sums).tolist()
    return loss_sum / max(count, 1.0)


def evaluate_and_record(run: Run, eval_ds: data_lib.TokenDataset, step: int, may_stop: bool = True) -> str | None:
    """Eval, log it, track the best; the status that ends the run at this eval (`early_stopped` by patience,
    `pruned` by a search's pruner), or None."""
    cfg, state = run.cfg, run.state
    eval_loss = evaluate(cfg, run.rt, run.model, eval_ds)
    state.last_eval_step = step
    record = {"event": "eval", "step": step, "eval_loss": eval_loss, "eval_ppl": safe_exp(eval_loss)}
    run.log.log(record)
    task_records = run_tasks(run, run.tasks, run.tokenizer, step,
                             lambda ds: evaluate(cfg, run.rt, run.model, ds)) if run.tasks else []
    # what a search reports: sweep.metric at this eval (harness tasks run on rank 0 only, and so does the pruner)
    value = swept_metric(cfg, record, task_records) if run.rt.is_main else math.nan
    report_findings(run.rt, state, run.log)
    if math.isfinite(eval_loss) and eval_loss < state.best_eval_loss:
        state.best_eval_loss, state.best_eval_step, state.evals_since_best = eval_loss, step, 0
    else:
        state.evals_since_best += 1
    if not may_stop:
        return None
    if run.rt.any_rank(run.pruning is not None and run.pruning.should_stop(step, value)):  # rank 0 asks
        run.log.log({"event": "pruned", "step": step, "reason": run.pruning.reason(step) if run.pruning else ""})
        return "pruned"
    patience = cfg.train.early_stopping_patience
    return "early_stopped" if patience and state.evals_since_best >= patience else None


def swept_metric(cfg: DictConfig, eval_record: dict[str, Any], task_records: list[dict[str, Any]]) -> float:
    """`sweep.metric` at this eval, on rank 0 (NaN when not finite: the pruner leaves it be). Validation knows
    every metric but a harness task's: one the harness does not record is the user's mistake, found at the
    first eval (exit 2, naming what the evals record)."""
    from llmexp.errors import UserError

    value = metric_at(str(cfg.sweep.metric), eval_record, task_records)
    if value is None:
        offered = ", ".join(f"tasks/{r['task']}/{m}" for r in task_records for m in r["metrics"])
        raise UserError(f"sweep.metric={cfg.sweep.metric}: the evals do not record it; they record eval_loss, "
                        f"eval_ppl{', ' + offered if offered else ''}")
    return value if math.isfinite(value) else math.nan
