"""Values derived from the composed config, resolved once at set-up and handed on: the model's sizes, the batch plan
(micro-batch x accumulation x processes), the world size, a data mix's quotas. The CLI's checks,
`python -m llmexp.estimate`, the DeepSpeed config and the trainer all ask these functions, so they can never disagree.
(The precision on this machine: `llmexp.machine.precision`.)"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmexp.errors import UserError

if TYPE_CHECKING:
    from omegaconf import DictConfig

WIDTH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
"""The sizes `model.width_mult` multiplies. The head size (hidden_size / num_attention_heads) stays fixed: heads
scale with the width, as muP's width scaling assumes (Tensor Programs V, section 8)."""


@dataclass(frozen=True)
class ModelSizes:
    """The sizes a model built from `model.*` has: the fields times `model.width_mult`. Everything that builds,
    estimates or checks such a model reads them here, so the sweep axis needs no hand-zipping of four keys."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def mup_width_mult(self, base_width: int) -> float:
        """muP's width multiplier m: this width over the one where muP equals standard."""
        return self.hidden_size / base_width

    def mup_base_sizes(self, base_width: int) -> dict[str, float]:
        """The base model muP's rules assume: every width over m (they scale every width with it, the head size
        fixed). A size that is not whole there means the model was not widened as a whole (`model.width_mult`)."""
        mult = self.mup_width_mult(base_width)
        return {k: getattr(self, k) / mult for k in WIDTH_KEYS}


def width_problems(m: Any) -> list[str]:
    """`model.width_mult` scales a model built from the fields, to whole sizes."""
    mult = float(m.width_mult)
    if mult == 1.0:
        return []
    if m.name_or_path:
        return [f"model.width_mult: {mult:g} scales a model built from the fields; model.name_or_path="
                f"{m.name_or_path} loads a pretrained one, whose sizes are fixed: drop model.width_mult"]
    broken = [f"{k}={m[k]} x {mult:g} = {m[k] * mult:g}" for k in WIDTH_KEYS if not float(m[k] * mult).is_integer()]
    return [f"model.width_mult: {mult:g} gives sizes that are not whole numbers ({'; '.join(broken)}); "
            "pick a factor that gives whole sizes, e.g. model.width_mult=2"] if broken else []


def model_sizes(m: Any) -> ModelSizes:
    return ModelSizes(**{k: round(m[k] * float(m.width_mult)) for k in WIDTH_KEYS})


MIX_ROUND = 1000
"""Training examples per round of a `data.mix`: each round holds every source's quota exactly."""


def use_shared_compile_cache(cfg: Any) -> None:
    """One torch.compile cache for every run and sweep job (`data.cache_dir/torchinductor`): compile pays for itself
    after ~40 steps, not ~400. Set before torch._dynamo is imported: its first look at the cache directory writes
    torch's default (`/tmp/torchinductor_<user>`) into TORCHINDUCTOR_CACHE_DIR, after which this is a no-op and
    every run on the machine shares that directory, whatever its settings (a run with the ISA capped by
    ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA read kernels compiled without the cap there and trained on NaNs). A value
    the user set wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cfg.data.cache_dir) / "torchinductor"))


def warmup_steps_for(max_steps: int, warmup_ratio: float, warmup_steps: int | None) -> int:
    """`warmup_steps` wins over `warmup_ratio`, as in HF TrainingArguments."""
    return warmup_steps if warmup_steps is not None else math.ceil(warmup_ratio * max_steps)


def warmup_problem(t: Any, s: Any, max_steps: int, run: str) -> tuple[str, str] | None:
    """(key, message) when `train` node `t`'s warm-up, rounded as the schedule does (`warmup_steps_for`), would not end
    before the run's `max_steps` (`run`: where they come from), nor under wsd (scheduler `s`) before its decay."""
    warmup = warmup_steps_for(max_steps, t.warmup_ratio, t.warmup_steps)
    decay = max(1, round(s.decay_ratio * max_steps)) if s.name == "wsd" else 0  # as `lr_at` splits a wsd run
    if warmup + max(decay, 1) <= max_steps or (t.warmup_steps is None and max_steps == 1):  # a ratio rounds 1 up
        return None
    key = "train.warmup_steps" if t.warmup_steps is not None else "train.warmup_ratio"
    wsd = f" plus wsd's decay ({decay} steps, scheduler.decay_ratio={s.decay_ratio:g})" if decay else ""
    return key, (f"warmup ({warmup} steps){wsd} must {'fit in' if decay else 'be shorter than'} {run}; lower "
                 f"train.warmup_steps/warmup_ratio{' or scheduler.decay_ratio' if decay else ''} or raise "
                 f"{'train.max_steps' if t.max_steps != -1 else 'train.num_train_epochs'}")


def mix_quotas(weights: list[float]) -> list[int]:
    """Examples per round for each `data.mix` source: the largest-remainder apportionment of MIX_ROUND,
    so the quotas sum to MIX_ROUND and each is within one example of its exact share."""
    total = sum(weights)
    exact = [w / total * MIX_ROUND for w in weights]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (quotas[i] - exact[i], i))
    for i in by_remainder[: MIX_ROUND - sum(quotas)]:
        quotas[i] += 1
    return quotas


def world_size_from_env() -> int:
    """As torchrun / accelerate launch / SLURM tell every rank."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_batch_size(value: Any) -> int | None:
    """`batch_size` as an int in [1, 2**63 - 1] (what a tensor's size can hold), None for `auto`; raises
    ValueError for anything else."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**63 - 1:
        raise ValueError(value)
    return value


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch splits into micro-batches and processes."""

    micro: int
    accum: int
    world: int
    fixed_steps: int
    epochs: float

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def max_steps(self, num_examples: int) -> int:
        by_epochs = max(1, math.ceil(self.epochs * num_examples / self.global_batch))
        return self.fixed_steps if self.fixed_steps > 0 else by_epochs


def global_batch_problem(global_batch: int | None, micro: int, world: int, auto: bool = False) -> str | None:
    """`train.global_batch_size` must split into micro-batch x processes x accumulation steps. With batch_size=auto
    (`auto`) the micro-batch is yet to be chosen among its divisors, so the processes alone must divide it."""
    per_step = world if auto else micro * world
    if global_batch is None or global_batch % per_step == 0:
        return None
    nearest = per_step * max(1, round(global_batch / per_step))
    if auto:
        return (f"train.global_batch_size={global_batch} is not a multiple of the {world} processes, so no "
                f"micro-batch for batch_size=auto divides it; pick a multiple of {world} (e.g. {nearest})")
    return (f"train.global_batch_size={global_batch} is not a multiple of batch_size x processes = "
            f"{micro} x {world} = {per_step}; pick a multiple of {per_step} (e.g. {nearest})")


def make_plan(cfg: DictConfig, world: int, micro: int | None = None) -> BatchPlan:
    """Derive accumulation from `train.global_batch_size` when it is set. `micro` is the micro-batch
    `batch_size=auto` chose (`llmexp.train.autobatch`); without one, batch_size=auto plans with 1 until it has."""
    t, micro = cfg.train, micro or parse_batch_size(cfg.batch_size) or 1
    global_batch, asked = t.global_batch_size, t.gradient_accumulation_steps
    if problem := global_batch_problem(global_batch, micro, world):
        raise UserError(problem)
    accum = asked if global_batch is None else global_batch // (micro * world)
    if asked not in (1, accum):  # set too (1 is its default), and it disagrees
        raise UserError(f"train.global_batch_size={global_batch} and train.gradient_accumulation_steps={asked} "
                        f"disagree: batch_size x processes x accumulation = {micro} x {world} x {asked}; set "
                        f"train.gradient_accumulation_steps={accum} (or drop it), or train.global_batch_size="
                        f"{micro * world * asked}")
    return BatchPlan(micro=micro, accum=accum, world=world, fixed_steps=t.max_steps, epochs=t.num_train_epochs)


AUTO_BATCH_MAX = 1024
"""The largest micro-batch batch_size=auto considers without other caps: beyond it a step gains no throughput
on any device (the matmuls are long saturated), and a search needs an upper end."""


def auto_batch_candidates(cfg: DictConfig, world: int, num_examples: int) -> list[int]:
    """The micro-batches batch_size=auto may pick, largest first, each at most 3/4 of the one before: powers of two
    and the sizes halfway between (3 x a power of two: 48 between 32 and 64), so that a choice leaves at most a
    third of the budget unused where halving could leave half of it.

    Capped at the global batch per process when `train.global_batch_size` is set (the global batch stays
    fixed, so the micro-batch must divide its per-process share: accumulation makes up the rest), and at the
    train set's per-process share when it is known (`num_examples`, 0 for a stream): a larger micro-batch
    would only repeat examples within one step."""
    global_batch = cfg.train.global_batch_size
    per_process = global_batch // world if global_batch is not None else None
    cap = AUTO_BATCH_MAX if per_process is None else min(AUTO_BATCH_MAX, per_process)
    if num_examples > 0:
        cap = min(cap, max(1, math.ceil(num_examples / world)))
    fits = ((lambda m: per_process % m == 0) if per_process is not None
            else (lambda m: m & (m - 1) == 0 or (m % 3 == 0 and (m // 3) & (m // 3 - 1) == 0)))
    chain = [next(m for m in range(cap, 0, -1) if fits(m))]
    while chain[-1] > 1:
        chain.append(next(m for m in range(chain[-1] * 3 // 4, 0, -1) if fits(m)))
    return chain
