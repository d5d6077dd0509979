"""A run's set-up, once the process (`runtime.Runtime`) and the data are known: `describe` resolves it into the
frozen `RunDescription` the loop reads; `start_facts` is the `start` record that describes it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from llmexp.config.derived import BatchPlan, make_plan, parse_batch_size, warmup_problem, warmup_steps_for
from llmexp.errors import UserError
from llmexp.machine.precision import BF16_EMULATION_ADVICE
from llmexp.model import build
from llmexp.model.cpu_matmul import MatmulPath, probe_once, route, widest_linear
from llmexp.model.facts import model_facts
from llmexp.model.loss import CausalLMLoss
from llmexp.monitor.detectors import MonitorSettings
from llmexp.monitor.throughput import flops_per_token, mfu_peak, process_age_s
from llmexp.train.autobatch import choose_batch_size
from llmexp.train.distributed import builds_cpu_lion
from llmexp.train.engines.base import Engine
from llmexp.train.engines.deepspeed import DeepSpeedEngine
from llmexp.train.engines.fsdp import FsdpEngine
from llmexp.train.engines.plain import PlainEngine
from llmexp.train.resume import saved_auto_batch
from llmexp.train.runtime import Runtime
from llmexp.train.schedule import resolve_lr
from llmexp.train.state import RunDescription


def describe(cfg: DictConfig, rt: Runtime, vocab_size: int, train_data: Any, data_fingerprint: str,
             lr_found: bool = False) -> tuple[RunDescription, Engine, torch.nn.Module, Any]:
    """Resolve everything the loop reads, once, in the order it depends on: the batch plan (batch_size=auto
    probes here, before any engine exists), the engine, the model and optimizer (whose size sets lr=auto and
    the FLOPs per token), the matmul ceiling, the monitor settings. `lr_found`: `cfg.lr` is lr=find's pick."""
    auto_batch = None
    if parse_batch_size(cfg.batch_size) is None:  # batch_size=auto: the checkpoint's choice, else estimate and probe
        auto_batch = choose_batch_size(cfg, rt, vocab_size, len(train_data), saved_auto_batch(cfg, rt.run_dir))
    plan = make_plan(cfg, rt.world, micro=auto_batch.chosen if auto_batch else None)
    engine = _engine(cfg, rt, plan)
    model, optimizer, built = _build(cfg, rt, engine, vocab_size, plan.micro * cfg.data.max_length)
    if lr_found:
        built["lr_source"] = "find"
    max_steps = plan.max_steps(len(train_data))
    if cfg.train.max_steps == -1 and plan.global_batch > cfg.train.num_train_epochs * len(train_data):
        epochs = cfg.train.num_train_epochs
        raise UserError(f"train.num_train_epochs={epochs} of this data is {epochs * len(train_data):,.0f} examples, "
                        f"fewer than one global batch of {plan.global_batch:,}: its one step would train past them; "
                        "lower batch_size or train.gradient_accumulation_steps, or set train.max_steps")
    run = f"the run's {max_steps} steps (train.num_train_epochs={cfg.train.num_train_epochs} of this data)"
    if cfg.train.max_steps == -1 and (problem := warmup_problem(cfg.train, cfg.scheduler, max_steps, run)):
        raise UserError(": ".join(problem))
    monitor = MonitorSettings(run_kind="finetune" if cfg.model.name_or_path else "pretrain",
                              max_grad_norm=cfg.train.max_grad_norm, precision=rt.precision.name, lr=built["lr"])
    desc = RunDescription(
        precision=rt.precision, plan=plan, auto_batch=auto_batch, monitor=monitor, max_steps=max_steps,
        warmup_steps=warmup_steps_for(max_steps, cfg.train.warmup_ratio, cfg.train.warmup_steps),
        data_fingerprint=data_fingerprint, started=rt.started,
        data_seed=cfg.train.seed_data if cfg.train.seed_data is not None else cfg.seed, **built)
    return desc, engine, model, optimizer


def _engine(cfg: DictConfig, rt: Runtime, plan: BatchPlan) -> Engine:
    if cfg.deepspeed.stage > 0:
        return DeepSpeedEngine(rt.accelerator, rt.precision.name, plan, cfg.deepspeed.stage, builds_cpu_lion(cfg))
    if cfg.fsdp.name != "none":
        return FsdpEngine(rt.accelerator, rt.precision.name, plan, cfg.fsdp.name, cfg.fsdp.cpu_offload)
    return PlainEngine(rt.accelerator, rt.precision.name, cfg.precision.init_scale, cfg.precision.growth_interval,
                       trainable_only=cfg.peft.name != "none")  # adapters: checkpoints hold only the trainable


def _build(cfg: DictConfig, rt: Runtime, engine: Engine, vocab_size: int,
           micro_tokens: int) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """Model (wrapped with its loss) and optimizer, prepared for this device, and the `RunDescription` fields
    their size decides: the parameter counts, through them lr=auto and MFU's FLOPs and ceiling, the model facts."""
    torch.manual_seed(cfg.seed)  # same init on every rank
    lm = build.build_model(cfg, vocab_size, rt.precision.name)
    _check_vocab(cfg, lm, vocab_size)
    matmul = cpu_matmul_path(cfg, rt, lm, micro_tokens)
    facts = model_facts(cfg, lm) | ({"cpu_matmul": matmul.record()} if matmul else {})
    total, c = build.count_params(lm, trainable_only=False), lm.config
    measured, mfu_note = (cfg.train.peak_tflops, None) if cfg.train.peak_tflops else rt.measure_peak()
    peak_tflops, peak_facts = ((measured, {"peak_tflops_source": "train.peak_tflops"}) if cfg.train.peak_tflops
                               else mfu_peak(rt.device, build.autocast_dtype(rt.precision.name), measured))
    facts |= peak_facts  # the start record names the peak MFU divides by, the measured ceiling beside it
    lr, lr_source = resolve_lr(cfg, total)
    # 6N FLOPs a token for trained weights; frozen ones (an adapter's base) 4N: they get no weight gradient
    built = dict(num_params=build.count_params(lm), total_params=total,
                 flops_per_token=flops_per_token(total, c.num_hidden_layers, c.hidden_size, cfg.data.max_length,
                                                 trainable=build.count_params(lm)),
                 peak_tflops=peak_tflops, mfu_note=mfu_note, lr=lr, lr_source=lr_source, model_facts=facts)
    if rt.compiles:
        compile_blocks(lm)
    loss_model = CausalLMLoss(lm)
    if matmul is not None and matmul.onednn:
        route(lm)
        loss_model.head_mm_t = matmul.matmul_t()
    model = engine.shard(loss_model)  # FSDP: before the optimizer sees the parameters
    optimizer = build.build_optimizer(cfg, model, lr, rt.device.type)
    model, optimizer = engine.prepare(model, optimizer)
    return model, optimizer, built


def compile_blocks(lm: torch.nn.Module) -> int:
    """torch.compile each decoder block in place (`nn.Module.compile`: parameter names unchanged), the model around
    them eager (why: docs/how-to/precision.md). The blocks are the classes transformers names as never to be split
    (`_no_split_modules`); a model that names none is compiled whole. Returns how many were compiled."""
    blocks = build.decoder_blocks(lm)
    for block in blocks or [lm]:
        block.compile()
    return len(blocks)


def _check_vocab(cfg: DictConfig, lm: torch.nn.Module, vocab_size: int) -> None:
    """A tokenizer with more tokens than the model has embedding rows: its top ids would index out of range at the
    first forward (an IndexError deep in torch), so it is refused here, before any step."""
    rows = lm.get_input_embeddings().num_embeddings
    if vocab_size > rows and cfg.data.tokenizer:
        raise UserError(f"data.tokenizer={cfg.data.tokenizer}: its {vocab_size} tokens outnumber the {rows} "
                        f"embedding rows of model.name_or_path={cfg.model.name_or_path}; use the model's own "
                        "tokenizer (data.tokenizer=null) or one made for it")
    if vocab_size > rows:  # the model's own tokenizer, grown (add_tokens) without resizing the embeddings
        raise UserError(f"model.name_or_path={cfg.model.name_or_path}: its tokenizer's {vocab_size} tokens "
                        f"outnumber its {rows} embedding rows; resize the model to its tokenizer "
                        "(model.resize_token_embeddings(len(tokenizer))) and save both again with save_pretrained")


def cpu_matmul_path(cfg: DictConfig, rt: Runtime, lm: torch.nn.Module, micro_tokens: int) -> MatmulPath | None:
    """Where this run's fp32 matmuls go on a CPU (`llmexp.model.cpu_matmul`); None off the CPU or outside fp32
    (bf16 autocast runs on oneDNN already; emulated bf16 owns its matmuls)."""
    if rt.device.type != "cpu" or rt.precision.name != "fp32":
        return None
    why_not = ("train.cpu_matmul=torch" if cfg.train.cpu_matmul == "torch"
               else "train.compile=true: inductor chooses the kernels" if cfg.train.compile
               else f"fsdp={cfg.fsdp.name} wraps the layers" if cfg.fsdp.name != "none"
               else f"deepspeed={cfg.deepspeed.name} wraps the layers" if cfg.deepspeed.stage > 0 else None)
    if why_not:
        return MatmulPath("torch", why_not)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    shape = widest_linear(lm, skip=head)
    if not shape:
        return MatmulPath("torch", "the model has no nn.Linear layer")
    return probe_once(Path(cfg.data.cache_dir) / "cpu_matmul.json", micro_tokens, *shape)


def start_facts(cfg: DictConfig, rt: Runtime, desc: RunDescription) -> dict[str, Any]:
    """The `start` record: the console header prints it, and the detectors turn `bf16_emulated` and `mfu_note`
    into findings."""
    facts: dict[str, Any] = {
        "lr_chosen": desc.lr, "lr_source": desc.lr_source, "num_params": desc.num_params,
        "global_batch_size": desc.plan.global_batch, "gradient_accumulation_steps": desc.plan.accum,
        "precision": desc.precision.name, "run_dir": str(rt.run_dir), "model": cfg.model.name,
        "model_path": cfg.model.name_or_path, "data": cfg.data.name, "max_length": cfg.data.max_length,
        "max_steps": desc.max_steps, "batch_size": desc.plan.micro, "world_size": desc.plan.world,
        "fsdp": cfg.fsdp.name, "optimizer": cfg.optimizer.name, "scheduler": cfg.scheduler.name,
        "precision_requested": desc.precision.requested, "device": rt.device.type, "peak_tflops": desc.peak_tflops,
        # Where a run's first minute goes: set-up (model, data, engine, ceiling) and, before it, the imports
        "setup_s": round(desc.elapsed(), 2), "process_s": round(process_age_s(), 2)}
    if rt.device.type == "cuda":
        facts["tf32"] = bool(cfg.precision.tf32)
    if desc.auto_batch:
        facts["batch_size_auto"] = asdict(desc.auto_batch)
    if desc.precision.warning:
        compile_note = ("; train.compile=true is not applied: torch.compile traces nothing under the emulation"
                        if cfg.train.compile and not rt.compiles else "")
        facts.update(bf16_emulated=desc.precision.warning + compile_note, bf16_advice=BF16_EMULATION_ADVICE)
    if desc.precision.bf16_slowdown is not None:
        facts.update(bf16_emulation=desc.precision.emulate_bf16, bf16_slowdown=desc.precision.bf16_slowdown)
    if desc.mfu_note:
        facts["mfu_note"] = desc.mfu_note
    facts.update(desc.model_facts, total_params=desc.total_params)
    return facts
