"""The training loop, top to bottom.

    train    setup (process, data, then the frozen run description: batch plan, engine, model, optimizer, lr)
    _start   -> (resume) -> the start record
    _loop    -> for each step:
                [eval] [samples] -> micro-batches (forward, backward) -> unscale -> grad norm + clip
                -> non-finite / spike check BEFORE the optimizer step -> optimizer step -> zero_grad
                -> [log] [save] [preempt?]
    _finish  -> final eval and samples -> model/ -> summary.json -> report

Everything that decides *what* to do lives in the components the loop calls (set-up, schedule, anomaly policy,
detectors, sampler, step engine, checkpoint I/O); the loop calls them in the right order and writes only its
`LoopState`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from llmexp.data import datasets as data_lib
from llmexp.data import stream as stream_lib
from llmexp.data.tokenizer import load_tokenizer
from llmexp.errors import RunFailed, UserError
from llmexp.evals.items import read_task_files
from llmexp.monitor.logger import safe_exp
from llmexp.monitor.throughput import peak_memory_mb
from llmexp.train import lr_find, samples
from llmexp.train.anomaly import judge_step, report_findings
from llmexp.train.eval_suite import TaskSuite, build_suite, run_tasks, scored_examples
from llmexp.train.finish import finish_run
from llmexp.train.preemption import PreemptionSignal
from llmexp.train.pruning import TrialPruning, sweep_value
from llmexp.train.resume import load_resume_state, rollback, save_state_checkpoint
from llmexp.train.runtime import Runtime
from llmexp.train.schedule import base_lr, lr_at, set_lr
from llmexp.train.setup import describe, start_facts
from llmexp.train.state import LoopState, Run


@dataclass
class RunResult:
    """What `train` returns: the final status and the summary written to summary.json."""

    status: str
    step: int
    summary: dict[str, Any]


def train(cfg: DictConfig) -> RunResult:
    """Train one run described by a composed, validated config: set up, start (or resume), loop, finish; writes
    the run directory. Signals are caught from the start: by `guarded.run_guarded`'s guard, entered before the
    trainer is imported (the one entered here then hands it out), else by the one entered here."""
    with PreemptionSignal() as preempt:
        task_files = read_task_files(cfg)  # before anything loads: a bad task file is exit 2 with nothing written
        rt = Runtime(cfg, Path(HydraConfig.get().runtime.output_dir))  # the job's output dir, every rank's
        tokenizer = load_tokenizer(cfg)
        build = stream_lib.build_stream_datasets if cfg.data.streaming else data_lib.build_datasets  # stream: uncached
        train_ds, eval_ds, data_stats = build(cfg, tokenizer)
        fingerprint = str(data_stats["data_cache_key"])
        cfg, found = lr_find.settle_lr(cfg, rt, len(tokenizer), train_ds, fingerprint, forward_backward)
        if found is not None and cfg.train.lr_find_only:
            return RunResult(status="completed", step=0, summary=found)
        desc, engine, model, optimizer = describe(cfg, rt, len(tokenizer), train_ds, fingerprint,
                                                  lr_found=found is not None)
        log = rt.logger(desc.max_steps)
        suite = build_suite(cfg, tokenizer, task_files, rt.is_main)  # eval=loss: None
        run = Run(cfg, rt, desc, engine, model, optimizer, log, train_data=train_ds, tokenizer=tokenizer,
                  pruning=TrialPruning.for_job(cfg, rt.is_main))  # a search's trial reports its evals to the study
        status = _start(run, data_stats, preempt)
        start_step = run.state.step
        try:
            status = _loop(run, eval_ds, suite, preempt, status)
        except UserError as err:
            if run.state.step == start_step:
                raise  # refused before any step: a refusal, as at set-up
            finish_run(run, "failed", user_error=str(err))  # found mid-run: the run says how it ended
            raise RunFailed(str(err)) from None
        return _finish(run, eval_ds, suite, status)


def _start(run: Run, data_stats: dict[str, Any], preempt: PreemptionSignal) -> str:
    """The loop state (a checkpoint's, or a fresh one) and the `start` record; the status the loop starts with:
    `completed` (go on), `failed` (no room for the start checkpoint) or `preempted` (a signal during start-up)."""
    cfg, rt, desc, train_ds = run.cfg, run.rt, run.desc, run.train_data
    run.state = state = load_resume_state(run) or LoopState()
    state.batch_size_auto = asdict(desc.auto_batch) if desc.auto_batch else {}  # checkpoints keep the choice
    train_ds.restore(state.data_state)  # a stream continues at its checkpoint's window; the cached data is stateless
    state.num_examples = len(train_ds)  # 0 for a stream: its length is unknown
    status = "completed"
    if cfg.train.on_anomaly == "rollback" and state.step == 0 and not save_state_checkpoint(run):
        status = "failed"  # the disk is full (reported); the start checkpoint is what a rollback goes back to
    run.log.log({"event": "start", "step": state.step, **start_facts(cfg, rt, desc), **data_stats})
    if rt.any_rank(preempt.requested):  # a signal during start-up: this is the first step boundary
        status = "preempted"
    return status


def lr_now(run: Run, step: int) -> float:
    """The scheduler's lr at `step`, times the loop state's scale (each rollback lowers it)."""
    s, desc = run.cfg.scheduler, run.desc
    return run.state.lr_scale * lr_at(step, name=s.name, peak_lr=desc.lr, max_steps=desc.max_steps,
                                      warmup_steps=desc.warmup_steps, min_lr_ratio=s.min_lr_ratio,
                                      decay_ratio=s.decay_ratio)


def _loop(run: Run, eval_ds: data_lib.TokenDataset, suite: TaskSuite | None, preempt: PreemptionSignal,
          status: str) -> str:
    """The steps, from the loop state's step to max_steps (while `status` stays `completed`); returns the status
    the run ends with. Only the loop state is written here."""
    cfg, rt, desc, state, log, window = run.cfg, run.rt, run.desc, run.state, run.log, run.window
    engine, model, optimizer, max_steps = run.engine, run.model, run.optimizer, desc.max_steps
    while status == "completed" and state.step < max_steps:
        step = state.step
        due = step % cfg.train.eval_steps == 0 and state.last_eval_step != step
        due = due and (step > 0 or cfg.train.eval_steps <= max_steps)  # step 0 only when evals fall inside the run
        if due and (stop := evaluate_and_record(run, eval_ds, suite, step)):
            # pruned: stopped as a preemption stops, with a checkpoint (a search may resume it by hand)
            status = stop if stop == "early_stopped" or save_state_checkpoint(run) else "failed"
            break
        if samples.due(cfg.train, step, max_steps):
            samples.record(run, step)  # on a forked RNG: training is bitwise unchanged
        set_lr(optimizer, lr_now(run, step))
        window.begin()
        loss_sum, n_targets, n_tokens = forward_backward(run, run.train_data)
        if engine.steps_first:  # DeepSpeed measures (and clips) the gradients only inside its own step
            engine.step(optimizer)
        grad_norm = engine.clip(model, optimizer, cfg.train.max_grad_norm, loss_sum.device)  # fp16: unscaled first
        # The step's one host read, on purpose, and read now, not a step late: skip and rollback veto this step's
        # optimizer step on its own loss and norm, so both must be on the host before it (stacked: one read).
        loss, grad_norm = torch.stack([rt.reduce_sum(loss_sum) / n_targets,
                                       grad_norm.float().reshape(())]).tolist()
        # Non-finite or spiking: the policy decides BEFORE the weights change (DeepSpeed: after, its step is taken).
        verdict = judge_step(run, loss, grad_norm)
        if verdict == "ok" and not engine.steps_first:
            state.skipped_steps += not engine.step(optimizer)  # optimizer.step(); fp16: the scaler skips overflows
        elif not engine.steps_first:
            engine.veto(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if verdict == "diverged":
            status = "diverged"
            break
        if verdict == "rollback":
            rollback(run)
            continue
        if rt.compiles and "train" not in window.compile_s:
            window.set_aside_compile("train")  # the first step compiles: report it apart
        else:
            window.add(n_tokens)
        state.step += 1
        log.advance()
        if state.step % cfg.train.logging_steps == 0 or state.step == max_steps:
            log.log(train_record(run, loss, grad_norm))
        saved = bool(cfg.train.save_steps) and state.step % cfg.train.save_steps == 0 and state.step < max_steps
        if saved and not save_state_checkpoint(run):
            status = "failed"  # the disk is full (reported; the older checkpoints are kept)
            break
        if rt.any_rank(preempt.requested):  # every rank must agree: saving is collective
            status = "preempted" if saved or save_state_checkpoint(run) else "failed"
            break
    return status


def _finish(run: Run, eval_ds: data_lib.TokenDataset, suite: TaskSuite | None, status: str) -> RunResult:
    """A run that ended by itself gets its last eval and samples; then every run its final checkpoint, model/,
    summary.json and report (`finish.finish_run`). Still inside the signal guard: a late SIGTERM only sets the
    flag, and the run finishes."""
    state = run.state
    if status in ("completed", "early_stopped") and state.last_eval_step != state.step:
        evaluate_and_record(run, eval_ds, suite, state.step, may_stop=False)
    if status in ("completed", "early_stopped") and run.cfg.train.sample_prompts:
        samples.record(run, state.step)
    summary = finish_run(run, status)
    return RunResult(status=summary["status"], step=state.step, summary=summary)  # a full disk: failed


def forward_backward(run: Run, train_ds: data_lib.TokenDataset | stream_lib.StreamDataset
                     ) -> tuple[torch.Tensor, int, int]:
    """Forward and backward over every micro-batch of one global batch: (loss sum on this rank, target tokens and
    tokens of the global batch). Each micro-batch's loss *sum* is divided by the global batch's target tokens, so
    accumulation and world size do not change the loss (a mean of means would)."""
    rt, plan, state, engine, model = run.rt, run.desc.plan, run.state, run.engine, run.model
    indices = train_ds.step_indices(run.desc.data_seed, state.step + state.data_offset, plan.global_batch)
    n_targets = max(1, train_ds.num_targets(indices))
    loss_sum = torch.zeros((), device=rt.device)
    n_tokens = 0

    def fetch(micro: int) -> dict[str, torch.Tensor]:  # pinned on CUDA: the copy does not wait on the host
        batch = train_ds.get_batch(data_lib.micro_batch(indices, rt.rank, plan.world, micro, plan.micro))
        pin = rt.device.type == "cuda"
        return {k: (v.pin_memory() if pin else v).to(rt.device, non_blocking=True) for k, v in batch.items()}

    batch = fetch(0)
    for micro in range(plan.accum):
        n_tokens += batch["input_ids"].numel()
        # DDP's all-reduce and FSDP2's reduce-scatter average over ranks: world / n_targets gives the global mean.
        sync = nullcontext() if micro == plan.accum - 1 else engine.no_sync(model)
        with rt.emulation():  # emulated bf16 (CPUs without it): backward's matmuls are bf16 too
            with sync, rt.autocast():
                micro_sum = model(**batch)
            if micro + 1 < plan.accum:  # the next micro-batch, read and copied while the device runs this forward
                batch = fetch(micro + 1)
            engine.backward(micro_sum * (plan.world / n_targets))
        loss_sum += micro_sum.detach()
    return loss_sum, n_targets, n_tokens * plan.world


@torch.no_grad()
def evaluate(run: Run, eval_ds: data_lib.TokenDataset) -> float:
    """Mean loss per target token over a fixed slice of the eval set, summed across ranks."""
    rt, plan, model = run.rt, run.desc.plan, run.model
    model.eval()
    stride, total_examples = plan.micro * plan.world, scored_examples(run, len(eval_ds))
    sums = torch.zeros(2, device=rt.device)
    starts = list(range(rt.rank * plan.micro, total_examples, stride))
    # FSDP: each forward all-gathers, so every rank runs as many; a rank out of examples repeats one, unsummed.
    rounds = -(-total_examples // stride) if run.engine.collective_forward else len(starts)
    for i in range(rounds):
        start = starts[i] if i < len(starts) else 0
        idx = torch.arange(start, min(start + plan.micro, total_examples)).numpy()
        batch = {k: v.to(rt.device) for k, v in eval_ds.get_batch(idx).items()}
        with rt.compute():
            loss_sum = model(**batch).float()
        if i < len(starts):
            sums[0] += loss_sum
            sums[1] += eval_ds.num_targets(idx)
    model.train()
    loss_sum, count = rt.reduce_sum(sums).tolist()
    return loss_sum / max(count, 1.0)


def evaluate_and_record(run: Run, eval_ds: data_lib.TokenDataset, suite: TaskSuite | None, step: int,
                        may_stop: bool = True) -> str | None:
    """Eval (the held-out loss, then the `eval` group's tasks), log it, track the best; the status that ends the run
    at this eval (`early_stopped` by patience, `pruned` by a search's pruner on `sweep.metric`), or None."""
    cfg, state = run.cfg, run.state
    run.window.begin()  # (the next train step begins its own timing)
    eval_loss = evaluate(run, eval_ds)
    if run.rt.compiles and "eval" not in run.window.compile_s:  # the first eval compiles the no-grad graph
        run.window.set_aside_compile("eval")
    state.last_eval_step = step
    record = {"event": "eval", "step": step, "eval_loss": eval_loss, "eval_ppl": safe_exp(eval_loss)}
    run.log.log(record)
    task_records = run_tasks(suite, run, step, lambda ds: evaluate(run, ds)) if suite else []
    value = sweep_value(cfg, record, task_records) if run.rt.is_main else math.nan  # harness tasks: rank 0's
    report_findings(run)
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


def train_record(run: Run, loss: float, grad_norm: float) -> dict[str, Any]:
    """The `train` record of the step just taken (throughput and MFU: of the window since the last record)."""
    state, plan = run.state, run.desc.plan
    tokens_per_sec = run.window.take()
    record = {"event": "train", "step": state.step, "loss": loss, "ppl": safe_exp(loss),
              "lr": base_lr(run.optimizer), "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
              "mfu": run.mfu(tokens_per_sec), "mem_mb": peak_memory_mb(run.rt.device),
              "epoch": state.step * plan.global_batch / state.num_examples if state.num_examples else None,
              "time_s": run.desc.elapsed(), "skipped_steps": state.skipped_steps}
    if note := run.mfu.take_note():  # said once, on the record where MFU stopped being reported
        record["mfu_note"] = note
    if (scale := run.engine.loss_scale()) is not None:
        record["loss_scale"] = scale
    return record
