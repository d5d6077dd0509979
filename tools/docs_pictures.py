"""Make the documentation's pictures from real tiny runs on this machine's CPU, through llmexp's own command line
(so the PNGs are the ones llmexp's report and plot code writes for any run):

    python tools/docs_pictures.py [--work DIR]    # ~5 minutes on a 2-core CPU; writes docs/assets/*.png

- run_curves.png        a run's curves (`python -m llmexp`: curves.png)
- lr_find.png           the lr finder's plot (`python -m llmexp.lr_find`: lr_find.png)
- sweep_curves.png      a grid's report plot (`python -m llmexp --multirun lr=...`: sweep_curves.png)
- search.png            a search's plot (`sweep=tpe sweep.pruner=asha`: sweep_search.png)
- doctor_finding.png    a run the doctor flags (lr=0.3, ~100x too high: its curves.png, findings marked); a run at
                        lr=3 diverges, for the doctor's error output (doctor.console)

Each run's console and the doctor's output are kept in the work directory (`*.console`), for the pages that
quote them. The model is the tests' tiny Llama (2 layers, hidden 64, vocabulary 512), on the stdlib data.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "docs" / "assets"
TINY = [
    "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
    "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=512",
    "model.max_position_embeddings=64", "data.max_length=64", "data.max_examples=400", "batch_size=4",
    "train.eval_batches=2",
]


def llmexp(work: Path, name: str, module: str, args: list[str]) -> int:
    """Run `python -m MODULE ARGS` in `work`, its console kept in `work/NAME.console`; returns its exit code."""
    env = {**os.environ, "LLMEXP_NO_BAR": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", module, *args]
    print("$", " ".join(command[1:]), flush=True)
    with open(work / f"{name}.console", "w") as console:
        console.write("$ python " + " ".join(command[1:]) + "\n")
        console.flush()
        return subprocess.run(command, cwd=work, env=env, stdout=console, stderr=subprocess.STDOUT).returncode


def copy(source: Path, name: str) -> None:
    if not source.is_file():
        raise SystemExit(f"{source} was not written: see the console files beside it")
    shutil.copyfile(source, ASSETS / name)
    print(f"  -> docs/assets/{name} ({source.stat().st_size // 1024} KiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="where the runs go (default: a temporary directory, kept)")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="llmexp-docs-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ASSETS.mkdir(parents=True, exist_ok=True)
    steps = ["train.max_steps=80", "train.eval_steps=20", "train.logging_steps=5"]

    llmexp(work, "run", "llmexp", [*TINY, *steps, f"hydra.run.dir={work / 'run'}"])
    copy(work / "run" / "curves.png", "run_curves.png")

    llmexp(work, "lr_find", "llmexp.lr_find", [*TINY, f"hydra.run.dir={work / 'lr_find'}"])
    copy(work / "lr_find" / "lr_find.png", "lr_find.png")

    llmexp(work, "grid", "llmexp", ["--multirun", *TINY, *steps, "lr=3e-4,1e-3,3e-3,1e-2", "cluster.max_parallel=2",
                                    f"hydra.sweep.dir={work / 'grid'}"])
    copy(work / "grid" / "sweep_curves.png", "sweep_curves.png")

    llmexp(work, "search", "llmexp", ["--multirun", *TINY, *steps, "sweep=tpe", "sweep.n_trials=8", "sweep.parallel=2",
                                      "sweep.pruner=asha", "sweep.seed=0", "lr=tag(log,interval(1e-4,1e-1))",
                                      f"hydra.sweep.dir={work / 'search'}"])
    copy(work / "search" / "sweep_search.png", "search.png")

    llmexp(work, "spike", "llmexp", [*TINY, *steps, "lr=0.3", f"hydra.run.dir={work / 'spike'}"])
    llmexp(work, "doctor_spike", "llmexp.doctor", [str(work / "spike")])  # (rewrites report.md and curves.png)
    copy(work / "spike" / "curves.png", "doctor_finding.png")

    llmexp(work, "diverged", "llmexp", [*TINY, *steps, "lr=3", f"hydra.run.dir={work / 'diverged'}"])
    llmexp(work, "doctor", "llmexp.doctor", [str(work / "diverged")])
    print(f"runs and consoles kept in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
