"""Bad invocations: each exits 2 before any model or data loads, names the key and the fix, no traceback.

Every case runs the real CLI (`python -m llmexp ...`) in a subprocess with real Hydra. Nothing is
mocked; one case simulates the machine instead: `WORLD_SIZE=2` stands for one rank of a 2-process launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, run_cli

# (id, args, extra env, fragments that must all appear in stderr: the key, then the fix)
CASES: list[tuple[str, list[str], dict[str, str], list[str]]] = [
    # typos in keys and group names
    ("key_typo", ["model.hiden_size=64"], {}, ["model.hiden_size", "did you mean model.hidden_size"]),
    ("group_typo", ["optimzer=adamw"], {}, ["optimzer", "did you mean optimizer"]),
    ("option_typo", ["model=tinyy"], {}, ["model=tinyy", "did you mean model=tiny"]),
    ("option_unknown", ["precision=fp8"], {}, ["precision=fp8", "bf16, fp16, fp32"]),
    ("key_in_wrong_place", ["max_steps=10"], {}, ["max_steps", "did you mean train.max_steps"]),
    ("plus_unknown_key", ["+unknown_key=1"], {}, ["unknown_key", "no such key"]),
    ("multirun_typo", ["--multirun", "lr=1e-3,3e-3", "model=tiny,tinyy"], {}, ["model=tinyy", "model=tiny"]),
    # what only a sweep acts on, on a single run: it would train here, silently
    ("single_run_on_slurm", ["cluster=slurm"], {}, ["cluster=slurm: only --multirun acts on it", "add --multirun"]),
    ("single_run_search", ["sweep=tpe"], {}, ["sweep=tpe: only --multirun acts on it"]),
    # a structured list item: Hydra keeps the reason in its error's cause
    ("mix_item_key_typo", ["data=hf", "data.mix=[{path: json, data_file: a.jsonl, weight: 1}]"], {},
     ["data.mix", "Because: Key 'data_file' not in 'MixSourceConfig'"]),
    ("mix_item_weight_text", ["data=hf", "data.mix=[{path: json, data_files: a.jsonl, weight: abc}]"], {},
     ["data.mix", "Because: Value 'abc' of type 'str' could not be converted to Float"]),
    # wrong types
    ("int_is_text", ["batch_size=abc"], {}, ["batch_size=abc", "must be an integer"]),
    ("int_is_float", ["train.max_steps=1.5"], {}, ["train.max_steps=1.5", "must be an integer"]),
    ("bool_is_text", ["train.compile=maybe"], {}, ["train.compile=maybe", "true or false"]),
    ("lr_is_text", ["lr=fast"], {}, ["lr:", "try lr=3e-4"]),
    # out of range
    ("lr_negative", ["lr=-1"], {}, ["lr:", "must be > 0"]),
    ("lr_zero", ["lr=0"], {}, ["lr:", "must be > 0"]),
    ("warmup_too_long", ["train.max_steps=20", "train.warmup_steps=20"], {},
     ["train.warmup_steps", "raise train.max_steps"]),
    ("warmup_ratio_one", ["train.warmup_ratio=1.0"], {}, ["train.warmup_ratio", "[0, 1)"]),
    ("batch_zero", ["batch_size=0"], {}, ["batch_size", "must be >= 1"]),
    ("eval_steps_zero", ["train.eval_steps=0"], {}, ["train.eval_steps", "must be >= 1"]),
    ("heads_do_not_divide", ["model.num_attention_heads=3", "model.num_key_value_heads=3"], {},
     ["model.hidden_size", "num_attention_heads=3"]),
    ("context_too_long", ["data.max_length=512"], {}, ["data.max_length", "max_position_embeddings"]),
    ("heads_zero", ["model.num_attention_heads=0"], {}, ["model.num_attention_heads", "must be >= 1"]),
    ("kv_heads_zero", ["model.num_key_value_heads=0"], {}, ["model.num_key_value_heads", "must be >= 1"]),
    ("seed_beyond_64_bits", ["seed=99999999999999999999999"], {}, ["seed:", "[0, 2**64 - 1]"]),
    ("seed_negative", ["seed=-1"], {}, ["seed:", "[0, 2**64 - 1]"]),
    ("lr_inf", ["lr=inf"], {}, ["lr:", "finite", "try lr=3e-4"]),
    ("weight_decay_inf", ["train.weight_decay=inf"], {}, ["train.weight_decay", "finite", "weight_decay=0.01"]),
    ("max_grad_norm_nan", ["train.max_grad_norm=nan"], {}, ["train.max_grad_norm", "finite"]),
    ("max_steps_beyond_64_bits", ["train.max_steps=99999999999999999999"], {}, ["train.max_steps", "64 bits"]),
    ("lr_find_start_subnormal", ["lr=find", "train.lr_find_start=1e-320", "train.lr_find_only=true"], {},
     ["train.lr_find_start: must be in [1e-12, 1], got 1e-320", "e.g. train.lr_find_start=1e-07"]),
    ("wandb_project_slash", ["logger=wandb", "logger.project=team/run"], {},
     ["logger.project: 'team/run' holds /", "none of / \\ # ? % :", "e.g. logger.project=llmexp"]),
    ("wandb_project_too_long", ["logger=wandb", "logger.project=" + "p" * 129], {},
     ["logger.project: is 129 characters long; at most 128"]),
    # required nodes deleted
    ("delete_train", ["~train"], {}, ["train:", "deleted", "remove"]),
    ("delete_seed", ["~seed"], {}, ["seed:", "deleted", "remove"]),
    ("delete_group", ["~model"], {}, ["model:", "no model is chosen", "model=tiny"]),
    ("bad_policy", ["train.on_anomaly=explode"], {}, ["train.on_anomaly", "stop, skip, rollback"]),
    ("bad_resume_data_mismatch", ["train.resume_data_mismatch=maybe"], {},
     ["train.resume_data_mismatch", "error, warn"]),
    ("global_batch_does_not_divide", ["batch_size=4", "train.global_batch_size=6"], {},
     ["train.global_batch_size=6", "pick a multiple of 4"]),
    # WORLD_SIZE=2 simulates one rank of a 2-process launch (torchrun/accelerate set it)
    ("global_batch_world_size", ["batch_size=4", "train.global_batch_size=12"], {"WORLD_SIZE": "2"},
     ["train.global_batch_size=12", "4 x 2 = 8"]),
    # hardware and engines (precision=bf16 on a CPU without native bf16 is no mistake: it runs emulated,
    # with a warning; tests/test_techniques.py)
    ("8bit_with_offload", ["optimizer=adamw8bit", "deepspeed=zero2_offload"], {},
     ["optimizer", "deepspeed=zero2"]),
    # missing files and values
    ("json_file_missing", ["data=json", "data.train_file=/nonexistent/train.jsonl"], {},
     ["data.train_file=/nonexistent/train.jsonl", "fix the path"]),
    ("text_glob_matches_nothing", ["data=text", "data.train_file=/nonexistent/*.txt"], {},
     ["data.train_file=/nonexistent/*.txt", "no such file"]),
    ("model_dir_missing", ["model.name_or_path=./no/such/model"], {}, ["model.name_or_path", "hub id"]),
    ("resume_missing", ["train.resume=/nonexistent/step_10"], {}, ["train.resume", "train.resume=auto"]),
    ("train_file_unset", ["data=json"], {}, ["data.train_file", "set data.train_file="]),
    ("value_left_missing", ["lr=???"], {}, ["lr:", "left unset", "set lr="]),
    ("env_var_missing", ["data.cache_dir=${oc.env:LLMEXP_NO_SUCH_VARIABLE}"], {},
     ["data.cache_dir", "LLMEXP_NO_SUCH_VARIABLE", "set the environment variable"]),
    # _target_ injections
    ("target_builtins_open", ["optimizer._target_=builtins.open"], {}, ["optimizer._target_", "optimizer=adamw"]),
    ("target_os_system", ["+foo._target_=os.system"], {}, ["foo._target_", "'os.system'"]),
    ("target_nested_popen", ["+optimizer.kwargs.x._target_=subprocess.Popen"], {},
     ["optimizer.kwargs.x._target_", "'subprocess.Popen'"]),
    ("target_dunder", ["optimizer._target_=torch.optim.__builtins__"], {}, ["optimizer._target_", "no dunders"]),
    ("target_hydra_instantiate", ["+hydra.callbacks.evil._target_=hydra.utils.instantiate"], {},
     ["hydra.callbacks.evil._target_", "'hydra.utils.instantiate'"]),
    ("target_interpolated", ["optimizer._target_=${oc.env:HOME}"], {}, ["optimizer._target_", "dotted class name"]),
    # path escapes
    ("job_name_escapes", ["hydra.job.name=../../escape"], {}, ["hydra.job.name", "'..'"]),
    ("group_option_escapes", ["experiment=../model/tiny"], {}, ["experiment=../model/tiny", "'..'"]),
    ("output_subdir_absolute", ["hydra.output_subdir=/tmp/llmexp-escape"], {}, ["hydra.output_subdir", "absolute"]),
    # remote code
    ("remote_code_unpinned", ["model.trust_remote_code=true", "model.name_or_path=some-org/some-model"], {},
     ["model.revision", "40-character commit hash"]),
    ("remote_code_branch", ["model.trust_remote_code=true", "model.name_or_path=some-org/some-model",
                            "model.revision=main"], {}, ["model.revision=main", "commit hash"]),
]


def run_llmexp(args: list[str], cwd: Path, env: dict[str, str] | None = None,
               code: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess (or `code` instead of `-m llmexp`). The checkout goes on PYTHONPATH so its
    Hydra plugins are found even where the editable install predates them."""
    full_env = {**os.environ, "LLMEXP_CACHE": str(cwd / "cache"), "WANDB_MODE": "offline", **(env or {})}  # a
    # cache of its own, so that a test can see it untouched
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "llmexp", *args]
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120)


def _assert_nothing_loaded(root: Path) -> None:
    for path in root.rglob("*"):
        assert path.name not in ("model", "metrics.jsonl", "checkpoints", "summary.json"), f"{path} was written"
    assert not (root / "cache").exists() or not any((root / "cache").iterdir()), "the data cache was touched"


@pytest.mark.parametrize(("args", "env", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_invocation_exits_2_naming_key_and_fix(args: list[str], env: dict[str, str], fragments: list[str],
                                                   tmp_path: Path) -> None:
    proc = run_llmexp([*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                      tmp_path, env)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
    _assert_nothing_loaded(tmp_path)


def test_corpus_is_large_and_covers_the_issue() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


def test_a_command_line_typo_creates_no_run_directory(tmp_path: Path) -> None:
    """Checked before Hydra composes: nothing is written at all."""
    proc = run_llmexp(["model.hiden_size=64", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2
    assert not (tmp_path / "run").exists()


_PROBE = """
import sys
from llmexp.cli.main import cli
sys.argv = ["llmexp", *sys.argv[1:]]
try:
    cli()
except SystemExit as exit_:
    heavy = sorted(m for m in ("torch", "transformers", "accelerate", "numpy") if m in sys.modules)
    print("EXIT", exit_.code, "HEAVY", ",".join(heavy) or "none")
"""


@pytest.mark.parametrize("args", [["lr=-1"], ["data=json", "data.train_file=/nonexistent.jsonl"],
                                  ["optimizer._target_=builtins.open"]], ids=["validate", "environment", "argv"])
def test_config_errors_never_import_torch(args: list[str], tmp_path: Path) -> None:
    proc = run_llmexp([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, code=_PROBE)
    assert "EXIT 2 HEAVY none" in proc.stdout, proc.stdout + proc.stderr


def _own_experiment(tmp_path: Path, name: str, yaml_text: str) -> subprocess.CompletedProcess[str]:
    """`python -m llmexp --config-dir DIR experiment=NAME`, DIR holding the user's own experiment/NAME.yaml."""
    conf = tmp_path / "extra" / "experiment"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / f"{name}.yaml").write_text(f"# @package _global_\n{yaml_text}")
    return run_llmexp(["--config-dir", str(tmp_path / "extra"), f"experiment={name}",
                       f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)


_WITHOUT_PACKAGE = """
import sys
sys.modules[sys.argv[1]] = None  # as if not installed: importlib.util.find_spec says None
sys.argv = ["llmexp", *sys.argv[2:]]
from llmexp.cli.main import main
main()
"""


@pytest.mark.parametrize("logger", ["wandb", "tensorboard", "mlflow"])
def test_a_tracker_without_its_package_exits_2_before_anything_is_written(logger: str, tmp_path: Path) -> None:
    """wandb and tensorboard were imported as the run started: a ModuleNotFoundError traceback, exit 1, and the
    run directory left behind (mlflow's was checked)."""
    proc = run_llmexp([logger, f"logger={logger}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                      code=_WITHOUT_PACKAGE)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"logger={logger} needs the {logger} package: pip install 'llmexp[{logger}]'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_nul_byte_from_a_yaml_file_is_refused(tmp_path: Path) -> None:
    """NUL cannot come through argv; a user's YAML (via --config-dir) can carry one in a path value."""
    proc = _own_experiment(tmp_path, "nul", 'data:\n  cache_dir: "/tmp/a\\0b"\n')
    assert proc.returncode == 2, proc.stderr
    assert "data.cache_dir: contains a NUL byte" in proc.stderr and "Traceback" not in proc.stderr


def test_a_typo_in_a_yaml_file_gets_the_command_lines_hint(tmp_path: Path) -> None:
    """Hydra names the config and the key only; the CLI adds what it says of the same typo on the command line."""
    proc = _own_experiment(tmp_path, "mine", "train:\n  max_step: 6\n")
    assert proc.returncode == 2 and "In 'experiment/mine'" in proc.stderr, proc.stderr
    assert "did you mean train.max_steps?" in proc.stderr and not (tmp_path / "run").exists()
    proc = run_llmexp(["data.cache_dir=/tmp/a cache é", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2 and "must be quoted, inside the shell's quotes" in proc.stderr, proc.stderr
    proc = run_llmexp(["data=hf", "data.mix=[{path: parquet, data_files: a.parquet, weight: 1, text_feild: body}]",
                       f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)  # the key Hydra names is the entry's own
    assert proc.returncode == 2 and "Key 'text_feild' not in 'MixSourceConfig'" in proc.stderr, proc.stderr
    assert "text_feild: no such key; the top level has" not in proc.stderr


def test_sweep_subdir_outside_the_sweep_dir_is_refused(tmp_path: Path) -> None:
    """`hydra.sweep.subdir` built from an override value must stay inside the sweep directory."""
    proc = run_llmexp(["--multirun", "hydra.sweep.subdir=${data.cache_dir}", f"data.cache_dir={tmp_path / 'elsewhere'}",
                       f"hydra.sweep.dir={tmp_path / 'sweep'}", "train.max_steps=1"], tmp_path)
    assert proc.returncode != 0
    assert "outside the sweep directory" in proc.stdout + proc.stderr + _job_logs(tmp_path)
    assert not (tmp_path / "elsewhere" / "metrics.jsonl").exists()


def _job_logs(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*.log"))


def test_an_argument_the_optimizer_rejects_exits_2(tmp_path: Path) -> None:
    """torch checks optimizer.kwargs only when the optimizer is built (after the data): still exit 2, no traceback."""
    result = run_cli([*TINY, "+optimizer.kwargs.eps=-1", "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
                     cwd=tmp_path, env={"LLMEXP_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "optimizer.kwargs" in result.stderr and "eps" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "model").exists()


def test_a_run_refused_while_it_sets_up_leaves_no_directory_but_keeps_an_earlier_runs(tmp_path: Path) -> None:
    """The optimizer's arguments are judged once it is built, after Hydra made the run directory: a refused fresh
    run removes it (Hydra's files, llmexp.log, the lock; in the working directory, only those) and the parents
    made for it, a refused rerun in a finished run's directory keeps it and its `.hydra/` as they were, and its
    job log says why."""
    env = {"LLMEXP_CACHE": str(tmp_path / "cache")}
    bogus = [*TINY, "+optimizer.kwargs.bogus=1", "train.max_steps=1"]
    refused = run_cli([*bogus, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "optimizer.kwargs" in refused.stderr and not (tmp_path / "run").exists()
    for subdir in ("null", "meta"):  # Hydra's config files in another subdirectory, or none: gone all the same
        refused = run_cli([*bogus, f"hydra.output_subdir={subdir}", f"hydra.run.dir={tmp_path / subdir}"],
                          cwd=tmp_path, env=env)
        assert refused.returncode == 2 and not (tmp_path / subdir).exists(), refused.stderr[-2000:]
    fresh = tmp_path / "fresh"  # the default outputs/<date>/<time>: the parents made for it go too
    fresh.mkdir()
    refused = run_cli(bogus, cwd=fresh, env=env)
    assert refused.returncode == 2 and not any(fresh.iterdir()), refused.stderr[-2000:]
    here = tmp_path / "here"  # hydra.run.dir=.: the start files go, the working directory stays
    here.mkdir()
    refused = run_cli([*bogus, "hydra.run.dir=."], cwd=here, env=env)
    assert refused.returncode == 2 and here.is_dir() and not any(here.iterdir()), refused.stderr[-2000:]
    done = run_cli([*TINY, "train.max_steps=1", "train.eval_steps=100", f"hydra.run.dir={tmp_path / 'done'}"],
                   cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    hydra_files = {p.name: p.read_bytes() for p in (tmp_path / "done" / ".hydra").iterdir()}
    refused = run_cli([*bogus, "train.resume=never", f"hydra.run.dir={tmp_path / 'done'}"], cwd=tmp_path, env=env)
    assert refused.returncode == 2 and (tmp_path / "done" / "metrics.jsonl").exists(), refused.stderr[-2000:]
    # the kept run's config is the one it ran with, not the refused one's
    assert {p.name: p.read_bytes() for p in (tmp_path / "done" / ".hydra").iterdir()} == hydra_files
    last = (tmp_path / "done" / "llmexp.log").read_text().splitlines()[-1]  # the kept run's log says why
    assert "refused: optimizer: torch.optim.AdamW rejected its arguments" in last and "bogus" in last, last


@pytest.mark.parametrize("subdir", [".hydra", "meta"])
def test_a_refusal_puts_back_the_hydra_files_it_could_read_and_no_others(subdir: str, tmp_path: Path) -> None:
    """What the CLI keeps of Hydra's config files (`hydra.output_subdir`) before Hydra writes: a readable file
    comes back byte for byte, one that was not there goes, and one that was there but could not be read (larger
    than its reader's 16 MiB) keeps what Hydra wrote rather than being removed."""
    from llmexp.rundir.lock import keep_hydra_files, put_back_hydra_files

    hydra = tmp_path / subdir
    hydra.mkdir()
    (hydra / "config.yaml").write_bytes(b"lr: 1\n")
    (hydra / "hydra.yaml").write_bytes(b"\0" * (16 * 2**20 + 1))
    keep_hydra_files(tmp_path, subdir)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):  # what Hydra writes for the refused run
        (hydra / name).write_bytes(b"refused\n")
    put_back_hydra_files(tmp_path)
    assert sorted(p.name for p in hydra.iterdir()) == ["config.yaml", "hydra.yaml"]
    assert (hydra / "config.yaml").read_bytes() == b"lr: 1\n" and (hydra / "hydra.yaml").read_bytes() == b"refused\n"


def test_an_empty_resume_is_one_message_naming_what_it_takes(tmp_path: Path) -> None:
    """train.resume defaults to auto, not null: an empty value is one mistake, one message, and it names the
    values the key takes (not "leave it out (null)")."""
    proc = run_llmexp(["train.resume=", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("train.resume:") == 1, proc.stderr
    assert "train.resume: must not be empty; set it to auto, never, or an existing checkpoint directory" in proc.stderr


def test_an_empty_harness_task_is_one_message_naming_the_fix(tmp_path: Path) -> None:
    """An empty name in eval.lm_eval.tasks is one mistake: one message, naming the item and the fix."""
    proc = run_llmexp(["eval.lm_eval.tasks=['']", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("eval.lm_eval.tasks") == 1, proc.stderr
    assert "eval.lm_eval.tasks[0]: must not be empty; remove it from the list" in proc.stderr


def test_a_run_into_a_sweeps_directory_and_a_sweep_into_a_runs_exit_2(tmp_path: Path) -> None:
    """Each would hide the other from llmexp.report and llmexp.status; both are refused before anything is written.
    (Files stand in for a finished sweep and run: the check reads which files a directory holds.)"""
    sweep, run = tmp_path / "sweep", tmp_path / "run"
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "0" / "metrics.jsonl").write_text("")
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    into_sweep = run_llmexp([f"hydra.run.dir={sweep}"], tmp_path)
    assert into_sweep.returncode == 2 and f"hydra.run.dir={sweep} holds a sweep" in into_sweep.stderr, into_sweep.stderr
    into_run = run_llmexp(["--multirun", "lr=1e-3,2e-3", f"hydra.sweep.dir={run}"], tmp_path)
    assert into_run.returncode == 2 and f"hydra.sweep.dir={run} holds a single run" in into_run.stderr, into_run.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_lock_file_that_is_a_directory_names_it_and_the_fix(tmp_path: Path) -> None:
    from llmexp.errors import UserError
    from llmexp.rundir.lock import LOCK_NAME, lock_run_dir

    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(UserError, match=rf"{LOCK_NAME} is a directory where llmexp keeps its lock file; remove it"):
        lock_run_dir(tmp_path)
