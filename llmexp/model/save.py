"""Writing a model directory: transformers' `save_pretrained`, without importing DeepSpeed for nothing.

`save_pretrained` first unwraps the model with accelerate's `extract_model_from_parallel`, which imports deepspeed
whenever it is installed, only to ask `isinstance(model, DeepSpeedEngine)`; and deepspeed's import pulls in
mlflow's (its autotuner's) when that is installed too. Together ~2 s of CPU, a fifth of a short run, at the end
of every run on every machine with the `all` extra (4 tiny steps on a 2-core Zen 5: 11.3 -> 9.0 CPU-seconds).
No object can be a DeepSpeedEngine in a process that never imported deepspeed, so while saving, accelerate's
availability check is narrowed to "already imported": a DeepSpeed run (which has imported it) is unwrapped as
before. accelerate has no switch for this; the workaround is this one attribute for the length of the call, and
if accelerate moves its check, saving works as before, only slower.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def save_model_dir(model: Any, out: Path, **kwargs: Any) -> None:
    """`model.save_pretrained(out, safe_serialization=True, **kwargs)`, a transformers or peft model."""
    import accelerate.utils.other as unwrapping  # where extract_model_from_parallel looks its check up

    original = getattr(unwrapping, "is_deepspeed_available", None)
    if original is not None:
        unwrapping.is_deepspeed_available = lambda: "deepspeed" in sys.modules and original()
    try:
        model.save_pretrained(out, safe_serialization=True, **kwargs)
    finally:
        if original is not None:
            unwrapping.is_deepspeed_available = original
