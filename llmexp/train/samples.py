"""Samples while training: the model continues `train.sample_prompts` every `train.sample_steps`. They must not
change training: rank 0 generates in eval mode, without gradients, on every device's RNG forked and seeded from
`train.sample_seed`, so the losses are bitwise the same with and without samples.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from llmexp.evals.score import prompt_budget
from llmexp.model.rng import eval_mode, rng_untouched
from llmexp.train.state import Run


def due(train: DictConfig, step: int, max_steps: int) -> bool:
    """Sample at step 0, every `sample_steps`, and at the end (only at the end when `sample_steps` is 0)."""
    every = train.sample_steps
    return bool(train.sample_prompts) and (step == max_steps or (every > 0 and step % every == 0))


@torch.no_grad()
def record(run: Run, step: int) -> None:
    """Continue each prompt (greedy, or sampled at `train.sample_temperature`) on rank 0 and log one `sample` event
    (metrics.jsonl, the console, wandb's table)."""
    train, rt, tokenizer = run.cfg.train, run.rt, run.tokenizer
    if not rt.is_main:
        return
    lm = run.engine.lm(run.model)
    sampled = train.sample_temperature > 0
    samples = []
    keep = prompt_budget(int(run.cfg.data.max_length), train.sample_max_new_tokens)  # as the generate tasks do
    with eval_mode(lm), rng_untouched(rt.device), rt.compute():
        torch.manual_seed(train.sample_seed)
        for prompt in train.sample_prompts:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"][:, -keep:]
            ids = ids.to(rt.device)
            out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=train.sample_max_new_tokens,
                              do_sample=sampled, temperature=train.sample_temperature if sampled else None,
                              top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            samples.append({"prompt": prompt, "completion": completion})
    run.log.log({"event": "sample", "step": step, "samples": samples})
