"""Exact resume after kill -9: the real CLI (`python -m llmexp`) is SIGKILLed at random points,
then started again with the same command (train.resume=auto, same hydra.run.dir). The final
metrics.jsonl (train loss, grad norm, lr, loss scale, eval loss of every step) and the final
weights must be bitwise equal to an uninterrupted run's.

Kills come two ways, both real SIGKILLs of the training process:
- from outside, at a random moment after a random step has been logged;
- from inside, at an exact point (before the n-th micro-batch backward, i.e. in the middle of an
  accumulation window; right after the n-th file of a checkpoint save; or during start-up, while
  the data is built), through a tiny hook that wraps one function and then starts the normal
  CLI. Only the moment is chosen; nothing else is replaced. The hook can send other signals
  than SIGKILL (SIGTERM, SIGINT, two SIGINTs: a second Ctrl-C).

Also here, end to end: checkpoints that verify but do not load, a resume on other data, a full
disk (a real small_fs) during a save.

benchmarks/kill_resume.py reuses this harness for 20 random kills.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import warm
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # ~25 CLI runs, forked warm (tests/warm.py): ~90 s on a 2-core Intel Xeon with AMX

MAX_STEPS = 16
TINY = (
    "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
    "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=512",
    "data.max_length=64", "batch_size=4", f"train.max_steps={MAX_STEPS}", "train.eval_steps=5",
    "train.eval_batches=2", "train.save_steps=3", "train.save_total_limit=2", "train.logging_steps=1",
    "train.resume=auto", "train.peak_tflops=1.0", "logger=jsonl",
)
# Kill from inside at an exact point, then run the normal CLI. LLMEXP_TEST_KILL_AT is
# "backward:<n>" (before the n-th micro-batch backward), "startup:1" (as the data is built) or
# "ckpt_file:<n>" (after the n-th checkpoint file written through llmexp.checkpoint.serialize.save_state /
# save_tensors). LLMEXP_TEST_KILL_SIGNALS lists the signals sent then (default SIGKILL); each
# one's handler has run before the next is sent (signal.raise_signal), as two key presses would.
KILL_HOOK = r"""
import os, signal, sys
kind, n = os.environ["LLMEXP_TEST_KILL_AT"].split(":")
signals = [getattr(signal, name) for name in os.environ.get("LLMEXP_TEST_KILL_SIGNALS", "SIGKILL").split(",")]
calls = [0]
def count_and_maybe_kill():
    calls[0] += 1
    if calls[0] == int(n):
        for sig in signals:
            signal.raise_signal(sig)
if kind == "backward":
    from llmexp.train.engines import plain as engine
    real_backward = engine.PlainEngine.backward
    def backward(self, loss):
        count_and_maybe_kill()
        return real_backward(self, loss)
    engine.PlainEngine.backward = backward
elif kind == "startup":
    from llmexp.data import datasets as data
    real_build = data.build_datasets
    def build_datasets(*args, **kwargs):
        count_and_maybe_kill()
        return real_build(*args, **kwargs)
    data.build_datasets = build_datasets
else:
    from llmexp.checkpoint import serialize as checkpoint
    for name in ("save_state", "save_tensors"):
        def wrapped(*args, _real=getattr(checkpoint, name), **kwargs):
            _real(*args, **kwargs)
            count_and_maybe_kill()
        setattr(checkpoint, name, wrapped)
from llmexp.cli.main import cli
sys.argv = ["llmexp", *sys.argv[1:]]
cli()
"""


@dataclass
class Kill:
    """One interruption: `at_step` (outside: after this step is logged, plus a random delay of
    up to `jitter_s`) or `hook` (inside: "backward:<n>" / "ckpt_file:<n>")."""

    at_step: int | None = None
    hook: str | None = None
    jitter_s: float = 0.0
    signum: int = signal.SIGKILL
    """SIGKILL, or SIGTERM/SIGUSR2/SIGINT for a preemption (the run saves and exits `preempted`)."""
    repeat: int = 1
    """hook only: how many times `signum` is sent (SIGINT twice: the second Ctrl-C ends the run at once)."""


def cli_env(cache_dir: Path) -> dict[str, str]:
    # One intra-op thread: on a busy 2-core machine two spinning OpenMP threads per run made the
    # steps ~20x slower. Every run of a comparison uses the same setting, so results stay comparable.
    env = {**os.environ, "LLMEXP_CACHE": str(cache_dir), "LLMEXP_NO_BAR": "1", "PYTHONHASHSEED": "0",
           "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def cli_args(run_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The CLI's arguments; an override of a key TINY sets replaces TINY's value."""
    keys = {o.split("=", 1)[0] for o in overrides}
    base = [o for o in TINY if o.split("=", 1)[0] not in keys]
    return [*base, *overrides, f"hydra.run.dir={run_dir}"]


def _train_steps(run_dir: Path) -> list[int]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        if record.get("event") == "train":
            steps.append(record["step"])
    return steps


def run_once(run_dir: Path, overrides: Sequence[str], env: dict[str, str], kill: Kill | None = None,
             rng: random.Random | None = None, timeout_s: float = 300) -> tuple[int, str]:
    """Run the CLI once, killed as `kill` says; returns (return code, output)."""
    log_path = run_dir.parent / f"{run_dir.name}.{time.time_ns()}.log"
    env = dict(env)
    if kill is not None and kill.hook:
        env["LLMEXP_TEST_KILL_AT"] = kill.hook
        env["LLMEXP_TEST_KILL_SIGNALS"] = ",".join([signal.Signals(kill.signum).name] * kill.repeat)
    hook = kill is not None and kill.hook is not None
    entry = ["-c", KILL_HOOK] if hook else ["-m", "llmexp"]
    proc = warm.popen(entry, cli_args(run_dir, overrides), cwd=run_dir.parent, env=env, stdout=log_path)
    try:
        if kill is not None and kill.at_step is not None:
            _kill_after_step(proc, run_dir, kill, rng or random.Random(0), timeout_s)
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log_path.read_text()


def _kill_after_step(proc: subprocess.Popen, run_dir: Path, kill: Kill, rng: random.Random, timeout_s: float) -> None:
    """SIGKILL once a train line with step >= kill.at_step appears, plus a random delay. Lines an
    earlier, killed process left behind do not count: the target is above all of them."""
    deadline = time.monotonic() + timeout_s
    # Capped at the last step: a target past it kills during the final eval/save/report instead.
    target = min(MAX_STEPS, max([kill.at_step or 0, *(s + 1 for s in _train_steps(run_dir))]))
    while proc.poll() is None and time.monotonic() < deadline:
        if any(step >= target for step in _train_steps(run_dir)):
            time.sleep(rng.uniform(0.0, kill.jitter_s))
            proc.send_signal(kill.signum)
            return
        time.sleep(0.02)


def fingerprint(run_dir: Path) -> dict[str, object]:
    """What must be bitwise equal: every train/eval number that does not measure time, and the
    final weights' hashes (the exported model and the last checkpoint's)."""
    train, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["event"] == "train":
            train.append((r["step"], r["loss"], r["grad_norm"], r["lr"], r["skipped_steps"], r.get("loss_scale")))
        elif r["event"] == "eval":
            evals.append((r["step"], r["eval_loss"]))
    last_ckpt = run_dir / "checkpoints" / f"step_{MAX_STEPS}" / "model.safetensors"
    exported = run_dir / "model" / "model.safetensors"
    if not exported.exists():  # peft: model/ holds the adapter
        exported = run_dir / "model" / "adapter_model.safetensors"
    return {"train": train, "eval": evals, "model": _sha256(exported),
            "checkpoint_model": _sha256(last_ckpt)}


def first_difference(expected: dict[str, object], got: dict[str, object]) -> str:
    """A readable account of where two fingerprints part ways ('' when they are equal)."""
    for key, want in expected.items():
        have = got.get(key)
        if want == have:
            continue
        if isinstance(want, list) and isinstance(have, list):
            for i, (a, b) in enumerate(zip(want, have, strict=False)):
                if a != b:
                    return f"{key}[{i}]: expected {a}, got {b}"
            return f"{key}: expected {len(want)} records, got {len(have)}"
        return f"{key}: expected {want}, got {have}"
    return ""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kill_resume_chain(run_dir: Path, overrides: Sequence[str], env: dict[str, str], kills: Sequence[Kill],
                      rng: random.Random, between: Callable[[int, Path], None] | None = None) -> list[str]:
    """Run, kill, resume, ... then finish; returns every run's output. `between(i, run_dir)`
    runs after the i-th kill (to corrupt a checkpoint, say)."""
    outputs = []
    for i, kill in enumerate(kills):
        code, out = run_once(run_dir, overrides, env, kill, rng)
        outputs.append(out)
        if kill.signum == signal.SIGKILL:
            assert code == -signal.SIGKILL, f"kill {i} ({kill}) did not land: exit {code}\n{out[-3000:]}"
        elif kill.signum == signal.SIGINT and kill.repeat > 1:  # the second Ctrl-C: gone at once
            assert code == -signal.SIGINT and "second Ctrl-C" in out, f"kill {i} ({kill}): exit {code}\n{out[-3000:]}"
        else:
            _check_preempted(run_dir, code, out)
        if between is not None:
            between(i, run_dir)
    code, out = run_once(run_dir, overrides, env)
    outputs.append(out)
    assert code == 0, f"the final resumed run failed: exit {code}\n{out[-3000:]}"
    return outputs


def _check_preempted(run_dir: Path, code: int, out: str) -> None:
    """A preempted run exits 1 with status `preempted` and a checkpoint of the step it stopped at."""
    from llmexp.checkpoint.store import list_checkpoints

    summary = json.loads((run_dir / "summary.json").read_text())
    assert (code, summary["status"]) == (1, "preempted"), f"exit {code}, {summary['status']}\n{out[-3000:]}"
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == f"step_{summary['step']}"


def random_kills(rng: random.Random, count: int, jitter_s: float = 0.3) -> list[Kill]:
    """`count` outside kills at increasing random steps in [1, MAX_STEPS - 2]."""
    steps = sorted(rng.sample(range(1, MAX_STEPS - 1), count))
    return [Kill(at_step=s, jitter_s=jitter_s) for s in steps]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return cli_env(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Callable[[tuple[str, ...]], dict]:
    """The uninterrupted run's fingerprint, per set of overrides (computed once)."""
    done: dict[tuple[str, ...], dict] = {}

    def get(overrides: tuple[str, ...]) -> dict:
        if overrides not in done:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            code, out = run_once(run_dir, overrides, env)
            assert code == 0, out[-3000:]
            done[overrides] = fingerprint(run_dir)
        return done[overrides]

    return get


# ----------------------------------------------------------------------------- tests


class Damage:
    """After a kill: damage the newest complete checkpoint, either flipping a byte of its weights
    or planting a pickle whose loading would write `marker` (with a manifest made to match, so
    only the safe loader stands in the way). The next resume must fall back past it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.paths: list[Path] = []

    def flip(self, run_dir: Path) -> None:
        path = self._newest(run_dir) / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
        self.paths.append(path)

    def poison(self, run_dir: Path) -> None:
        newest = self._newest(run_dir)
        path = newest / "optimizer.pt"
        path.write_bytes(pickle.dumps(_Evil(self.marker), protocol=2))
        manifest = json.loads((newest / "manifest.json").read_text())
        manifest["files"]["optimizer.pt"] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        (newest / "manifest.json").write_text(json.dumps(manifest))
        self.paths.append(path)

    @staticmethod
    def _newest(run_dir: Path) -> Path:
        from llmexp.checkpoint.store import list_checkpoints

        found = list_checkpoints(run_dir / "checkpoints")
        assert found, f"no checkpoint to damage in {run_dir}"
        return found[-1]


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def _seed() -> int:
    return int(os.environ.get("LLMEXP_TEST_SEED", random.randrange(10**6)))


def test_kill9_mid_window_mid_save_random_and_preempted(tmp_path: Path, env: dict[str, str], reference) -> None:
    """accum=4, four kills in one run, each followed by a resume with the same command:
    1. in step 6 after 2 of its 4 micro-batches (backward call 23);
    2. in the save at step 9, right after its model file (checkpoint file 4 of the resumed run);
       then the newest checkpoint (step 6) gets a flipped byte;
    3. at a random moment after a random step; then the newest checkpoint is poisoned with a
       malicious pickle;
    4. SIGTERM (preemption) after a later random step: the run saves at the step boundary and
       exits 1 with status `preempted`.
    Resume falls back past each damaged checkpoint naming the file, never runs the pickle, and
    the run ends bitwise equal to the uninterrupted one."""
    overrides = ("precision=fp32", "train.gradient_accumulation_steps=4")
    want = reference(overrides)
    seed = _seed()
    rng = random.Random(seed)
    # Kill 3 lands within a step or two of step 10-11 (an idle machine runs ~30 tiny steps a
    # second), so the SIGTERM at step 13-14 still finds the loop running: a SIGTERM after the last
    # step only lets the run finish, and it would not be a preemption.
    first, second = rng.randint(10, 11), rng.randint(13, 14)
    kills = [Kill(hook="backward:23"), Kill(hook="ckpt_file:4"), Kill(at_step=first, jitter_s=0.05),
             Kill(at_step=second, signum=signal.SIGTERM)]
    damage = Damage(tmp_path / "marker")

    def between(i: int, run_dir: Path) -> None:
        if i == 1:
            damage.flip(run_dir)
        elif i == 2:
            damage.poison(run_dir)

    outputs = kill_resume_chain(tmp_path / "run", overrides, env, kills, rng, between)
    got = fingerprint(tmp_path / "run")
    assert got == want, f"seed {seed}, kills {kills}: {first_difference(want, got)}; runs in {tmp_path}"
    left = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert not [name for name in left if name.startswith(".tmp-")], left  # dead writers' leftovers cleaned
    assert len(left) <= 2 + 1, left  # save_total_limit=2, plus the best
    flipped, poisoned = damage.paths
    assert str(flipped) in outputs[2] and "sha256" in outputs[2], outputs[2][-3000:]
    assert str(poisoned) in outputs[3], outputs[3][-3000:]
    assert not damage.marker.exists()


def test_kill9_under_fp16_loss_scaling(tmp_path: Path, env: dict[str, str], reference) -> None:
    """fp16 with dynamic loss scaling (the scale grows every 2 clean steps and halves on an
    overflow, which skips the step): killed mid-window (accum=2, after micro-batch 1 of step 5). The scaler
    state must come back exactly. (Random kill points are the first test's; one kill is what this path needs.)"""
    overrides = ("precision=fp16", "precision.growth_interval=2", "train.gradient_accumulation_steps=2")
    ref = reference(overrides)
    scales = {r[-1] for r in ref["train"]}
    assert len(scales) > 1, f"the loss scale never moved ({scales}): the test would not test the scaler"
    kill_resume_chain(tmp_path / "run", overrides, env, [Kill(hook="backward:10")], random.Random(0))
    got = fingerprint(tmp_path / "run")
    assert got == ref, f"{first_difference(ref, got)}; runs in {tmp_path}"


def test_kill9_with_lora_adapters(tmp_path: Path, env: dict[str, str], reference) -> None:
    """peft=lora with adapter dropout (its RNG must come back too), accum=2: killed mid-window (after
    micro-batch 1 of step 4). The run ends bitwise equal to the uninterrupted
    one, and its checkpoints hold only what resume needs: the adapters and their optimizer state."""
    from safetensors import safe_open

    overrides = ("precision=fp32", "peft=lora", "peft.r=4", "peft.lora_dropout=0.1",
                 "train.gradient_accumulation_steps=2")
    want = reference(overrides)
    kill_resume_chain(tmp_path / "run", overrides, env, [Kill(hook="backward:7")], random.Random(0))
    got = fingerprint(tmp_path / "run")
    assert got == want, f"{first_difference(want, got)}; runs in {tmp_path}"
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{MAX_STEPS}"
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    # 2 layers x 7 linear layers (q, k, v, o, gate, up, down) x (lora_A, lora_B)
    assert len(keys) == 28 and all(".lora_A." in k or ".lora_B." in k for k in keys), keys
    import torch

    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(keys), len(optimizer["state"])


def test_kill9_before_the_first_checkpoint(tmp_path: Path, env: dict[str, str], reference) -> None:
    """Killed inside the first save (so no checkpoint exists yet), then started again: the run
    starts over, and metrics.jsonl must not keep the killed attempt's lines (duplicate steps)."""
    overrides = ("precision=fp32", "train.gradient_accumulation_steps=4")
    want = reference(overrides)
    kill_resume_chain(tmp_path / "run", overrides, env, [Kill(hook="ckpt_file:2")], random.Random(0))
    got = fingerprint(tmp_path / "run")
    assert got == want, f"{first_difference(want, got)}; runs in {tmp_path}"


def test_ctrl_c_checkpoints_and_a_second_ctrl_c_exits_at_once(tmp_path: Path, env: dict[str, str],
                                                             reference) -> None:
    """Ctrl-C (SIGINT) in the middle of an accumulation window: the run finishes the step, saves
    a checkpoint and exits 1 with status `preempted`, like SIGTERM; the resumed run gets two
    Ctrl-Cs and dies at once (no checkpoint); the last run resumes from the checkpoint of the
    first and ends bitwise equal to an uninterrupted run. (Before: a KeyboardInterrupt traceback,
    no checkpoint, no summary.)"""
    overrides = ("precision=fp32", "train.gradient_accumulation_steps=4")
    want = reference(overrides)
    kills = [Kill(hook="backward:23", signum=signal.SIGINT), Kill(hook="backward:6", signum=signal.SIGINT, repeat=2)]
    outputs = kill_resume_chain(tmp_path / "run", overrides, env, kills, random.Random(0))
    assert "SIGINT: saving a checkpoint at the next step boundary" in outputs[0], outputs[0][-3000:]
    assert not [out for out in outputs if "Traceback" in out], outputs
    got = fingerprint(tmp_path / "run")
    assert got == want, f"{first_difference(want, got)}; runs in {tmp_path}"


def test_sigterm_during_startup_ends_cleanly(tmp_path: Path, env: dict[str, str], reference) -> None:
    """A SIGTERM while the data is being built (before the loop) no longer kills the process: it
    stops at the first step boundary with status `preempted` (exit 1, summary.json, no traceback),
    and the next run trains as if nothing had happened. (Before: killed by the signal.)"""
    overrides = ("precision=fp32", "train.gradient_accumulation_steps=4")
    want = reference(overrides)
    run_dir = tmp_path / "run"
    code, out = run_once(run_dir, overrides, env, Kill(hook="startup:1", signum=signal.SIGTERM))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (code, summary["status"], summary["step"]) == (1, "preempted", 0), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    code, out = run_once(run_dir, overrides, env)
    assert code == 0, out[-3000:]
    got = fingerprint(run_dir)
    assert got == want, f"{first_difference(want, got)}; runs in {tmp_path}"


def _rehash(checkpoint: Path, rel: str) -> None:
    """Make the manifest match a file changed on purpose, so only loading can tell."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    path = checkpoint / rel
    manifest["files"][rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_checkpoints_that_verify_but_do_not_load_fall_back(tmp_path: Path, env: dict[str, str]) -> None:
    """A finished run's three newest checkpoints are damaged with manifests made to match: invalid
    JSON in trainer_state.json (step 16), an unknown key in the trainer state (15), a weight of
    another shape (12). Run again, the resume warns about each, naming the file, falls back to
    step 9 and ends bitwise equal to the first run. (Before: the resume crashed.)"""
    from safetensors.torch import load_file, save_file

    overrides = ("precision=fp32", "train.save_total_limit=6")
    run_dir = tmp_path / "run"
    code, out = run_once(run_dir, overrides, env)
    assert code == 0, out[-3000:]
    want = fingerprint(run_dir)
    ckpts = run_dir / "checkpoints"
    (ckpts / "step_16" / "trainer_state.json").write_text('{"state": {"step": 16,')
    state = json.loads((ckpts / "step_15" / "trainer_state.json").read_text())
    state["state"]["from_the_future"] = 1
    (ckpts / "step_15" / "trainer_state.json").write_text(json.dumps(state))
    weights = load_file(str(ckpts / "step_12" / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name].reshape(-1)[:-1].clone()
    save_file(weights, str(ckpts / "step_12" / "model.safetensors"))
    for step, rel in ((16, "trainer_state.json"), (15, "trainer_state.json"), (12, "model.safetensors")):
        _rehash(ckpts / f"step_{step}", rel)
    code, out = run_once(run_dir, overrides, env)
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for what in (f"{ckpts / 'step_16' / 'trainer_state.json'}: not valid JSON",
                 f"{ckpts / 'step_15' / 'trainer_state.json'}: unknown key 'from_the_future'",
                 f"{ckpts / 'step_12' / 'model.safetensors'}: {name} has shape"):
        assert what in out, out[-3000:]
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in resumed if r["event"] == "resume"] == [str(ckpts / "step_9")]
    got = fingerprint(run_dir)
    assert got == want, f"{first_difference(want, got)}; runs in {tmp_path}"


def _jsonl(path: Path, n: int) -> Path:
    """n text records: a small data file whose content the test can change."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=40))}) + "\n" for _ in range(n)))
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_on_other_data_is_refused_unless_told(tmp_path: Path, env: dict[str, str]) -> None:
    """The data file changes between a run and its resume: the resume exits 2 naming both data
    fingerprints and train.resume_data_mismatch, leaving metrics and checkpoints as they were;
    with train.resume_data_mismatch=warn it warns and goes on. (Before: not noticed.)"""
    data = _jsonl(tmp_path / "train.jsonl", 80)
    run_dir = tmp_path / "run"
    overrides = ("data=json", f"data.train_file={data}", "train.max_steps=4", "precision=fp32")
    code, out = run_once(run_dir, overrides, env)
    assert code == 0, out[-3000:]
    saved = json.loads((run_dir / "checkpoints" / "step_4" / "manifest.json").read_text())
    before_fp = saved["extra"]["resume_key"]["data"]
    before = {**_tree(run_dir / "checkpoints"), "metrics.jsonl": (run_dir / "metrics.jsonl").read_bytes()}
    _jsonl(data, 81)
    code, out = run_once(run_dir, overrides, env)
    assert code == 2, out[-3000:]
    error = [line for line in out.splitlines() if line.startswith("llmexp: error:")]
    assert len(error) == 1 and before_fp in error[0] and "train.resume_data_mismatch=warn" in error[0], out[-3000:]
    assert "Traceback" not in out
    after = {**_tree(run_dir / "checkpoints"), "metrics.jsonl": (run_dir / "metrics.jsonl").read_bytes()}
    assert after == before
    code, out = run_once(run_dir, (*overrides, "train.resume_data_mismatch=warn"), env)
    assert code == 0, out[-3000:]
    assert f"saved with data fingerprint {before_fp}" in out and "resuming anyway" in out, out[-3000:]


def test_resume_with_another_optimizer_or_model_is_refused_leaving_no_directory(tmp_path: Path,
                                                                                 env: dict[str, str]) -> None:
    """Another optimizer's state loaded without complaint and its first step raised KeyError (exit 1); a refused
    resume into a new directory left that directory behind (llmexp.log and an empty metrics.jsonl)."""
    overrides = ("train.max_steps=4", "precision=fp32")
    code, out = run_once(tmp_path / "run", overrides, env)
    assert code == 0, out[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step_4"
    for extra, message in (("optimizer=sgd", f"checkpoint {ckpt} holds adamw's optimizer state, which optimizer=sgd "
                                             "cannot take; resume with optimizer=adamw"),
                           ("model.hidden_size=32", "the model's is")):
        new = tmp_path / extra.split("=")[0]
        code, out = run_once(new, ("train.max_steps=6", "precision=fp32", f"train.resume={ckpt}", extra), env)
        assert code == 2 and message in out and "start over with train.resume=never" in out, out[-3000:]
        assert not new.exists() and "Traceback" not in out
    # train.resume=auto in the run's own directory: another layout made every checkpoint "unusable" and the run
    # started from scratch over them (metrics.jsonl, summary.json, model/ rewritten); a setting the optimizer
    # state restores (each group's weight decay) was taken without a word and never applied.
    run_dir, kept = tmp_path / "run", ("metrics.jsonl", "summary.json", "model/model.safetensors")
    before = {name: (run_dir / name).read_bytes() for name in kept}
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for extra, message in (("model.hidden_size=32", "the model's is"),
                           ("model.parametrization=mup", "do not fit the optimizer's [14, 1, 1, 5] (model.param"),
                           ("train.weight_decay=0.5", "saved with train.weight_decay=0.01, which its optimizer state "
                                                      "keeps")):
        code, out = run_once(run_dir, ("train.max_steps=6", "precision=fp32", "model.mup_base_width=32", extra), env)
        assert code == 2 and message in out and "start over with train.resume=never" in out, out[-3000:]
    assert {name: (run_dir / name).read_bytes() for name in kept} == before
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints


def test_resume_with_other_mup_multipliers_says_so(tmp_path: Path, env: dict[str, str]) -> None:
    """model.mup_output_mult changes what the model computes, not its shapes: a resume after changing it warns
    naming the key and both values, as one after changing the lr does. (Before: not noticed.)"""
    run_dir = tmp_path / "run"
    overrides = ("model.parametrization=mup", "model.mup_base_width=32", "train.max_steps=4", "precision=fp32")
    code, out = run_once(run_dir, overrides, env)
    assert code == 0, out[-3000:]
    code, out = run_once(run_dir, (*overrides, "model.mup_output_mult=2", "lr=1e-3"), env)
    assert code == 0, out[-3000:]
    for key, now, saved in (("model.mup_output_mult", "2.0", "1.0"), ("lr", "0.001", "auto")):
        assert f"resuming step_4 with {key}={now}, but it was saved with {saved};" in out, out[-3000:]


def test_full_disk_during_a_save(small_fs: Path, env: dict[str, str], reference) -> None:
    """The run directory is on a 3 MiB filesystem: step_3 fits, the save of step_6 runs out of
    space. The run says "no space left" with the path, writes summary.json (status failed),
    keeps step_3 and exits 1 without a traceback. Given room, the same command resumes from
    step_3 and ends bitwise equal to an uninterrupted run. (Before: a bare RuntimeError
    "unexpected pos", no summary.)"""
    import subprocess as sp

    from llmexp.checkpoint.store import list_checkpoints, verify_checkpoint

    overrides = ("precision=fp32", "train.gradient_accumulation_steps=4")
    want = reference(overrides)
    run_dir = small_fs / "run"
    code, out = run_once(run_dir, overrides, env)
    assert code == 1, out[-3000:]
    assert f"no space left on device while writing {run_dir / 'checkpoints' / 'step_6'}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["step"]) == ("failed", 6)
    kept = list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in kept] == ["step_3"]
    verify_checkpoint(kept[0])
    sp.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)
    code, out = run_once(run_dir, overrides, env)
    assert code == 0, out[-3000:]
    got = fingerprint(run_dir)
    assert got == want, f"{first_difference(want, got)}; runs in {small_fs}"
