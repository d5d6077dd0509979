"""Every key that names a file or directory is checked on this machine before anything is written
(`llmexp.machine.paths`): run, sweep and cache directories that are files or symbolic link loops; `data=hf`
on empty files and on loading scripts; model directories with pickled weights, code of their own, or an
adapter instead of a model. Each is one exit-2 message naming the key and the fix, and no code runs.

Refusals go through the real CLI in this process (`cli_refusal`); one of each class also in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from llmexp.machine.paths import dir_out_problem, model_dir_problem
from tests.conftest import TINY, Launched, run_cli

MARKER = "LLMEXP_TEST_CODE_RAN"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Files and directories the cases point at: a file, a symlink loop, empty and script-bearing data."""
    (tmp_path / "a_file").write_text("x\n")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "rows.jsonl").write_text('{"text": "hello"}\n' * 20)
    scripted = tmp_path / "scripted"
    scripted.mkdir()
    (scripted / "scripted.py").write_text(f"open({str(tmp_path / MARKER)!r}, 'w').close()\n")
    (scripted / "train.jsonl").write_text('{"text": "hello"}\n')
    no_text = tmp_path / "no_text"  # data=text reads neither hidden nor empty files
    no_text.mkdir()
    (no_text / ".notes").write_text("hidden\n")
    (no_text / ".git").mkdir()  # nor a hidden directory's files: a checkout's .git/HEAD is no text to train on
    (no_text / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (no_text / "empty.txt").write_text("")
    for step in (9, 10):  # a run's checkpoints, without manifests: as far as the hint reads them
        (tmp_path / "old_run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
    return tmp_path


def _model_dir(path: Path, weights: str | None = "model.safetensors", config: dict | None = None,
               files: dict[str, str] | None = None) -> Path:
    """A model directory as far as llmexp's check reads it: file names and config.json."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    if weights:
        (path / weights).write_bytes(b"\0" * 8)
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def _code_that_marks(tmp_path: Path) -> str:
    """Python that leaves a marker file if it is ever imported: the proof that no code ran."""
    return f"open({str(tmp_path / MARKER)!r}, 'w').close()\nraise SystemExit('code ran')\n"


@pytest.fixture
def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    _model_dir(root / "pickled", weights="pytorch_model.bin")
    _model_dir(root / "custom", config={"model_type": "x-custom", "auto_map": {
        "AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}},
        files={"configuration_x.py": _code_that_marks(tmp_path), "modeling_x.py": _code_that_marks(tmp_path)})
    adapter = root / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base",
                                                             "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    shutil.copytree(adapter, root / "merged_adapter")
    _model_dir(root / "merged_adapter" / "merged")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"auto_map": {
        "AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    (tokenizer / "tokenization_x.py").write_text(_code_that_marks(tmp_path))
    run = root / "run"
    _model_dir(run / "model")
    return root


# (id, overrides given the tree's root, fragments of stderr: the key, then the fix)
PATH_MISTAKES: list[tuple[str, list[str], list[str]]] = [
    # class 6: run, sweep and cache directories
    ("run_dir_is_a_file", ["hydra.run.dir={t}/a_file"], ["hydra.run.dir={t}/a_file: is a file, not a directory"]),
    ("run_dir_is_a_loop", ["hydra.run.dir={t}/loop"], ["hydra.run.dir={t}/loop: is a symbolic link loop"]),
    ("run_dir_below_a_file", ["hydra.run.dir={t}/a_file/run"], ["hydra.run.dir={t}/a_file/run", "is a file"]),
    ("run_dir_below_a_loop", ["hydra.run.dir={t}/loop/run"], ["hydra.run.dir={t}/loop/run", "symbolic link loop"]),
    ("sweep_dir_is_a_file", ["--multirun", "lr=1e-3,2e-3", "hydra.sweep.dir={t}/a_file"],
     ["hydra.sweep.dir={t}/a_file: is a file, not a directory"]),
    ("sweep_dir_is_a_loop", ["--multirun", "sweep=tpe", "lr=interval(1e-4,1e-3)", "hydra.sweep.dir={t}/loop"],
     ["hydra.sweep.dir={t}/loop: is a symbolic link loop"]),
    ("cache_dir_is_a_file", ["data.cache_dir={t}/a_file"], ["data.cache_dir={t}/a_file: is a file, not a directory"]),
    ("cache_dir_is_a_loop", ["data.cache_dir={t}/loop"], ["data.cache_dir={t}/loop: is a symbolic link loop"]),
    ("cache_dir_of_a_sweep", ["--multirun", "lr=1e-3,2e-3", "data.cache_dir={t}/loop"],
     ["data.cache_dir={t}/loop: is a symbolic link loop"]),
    # class 4: data=hf on empty files and loading scripts
    ("hf_empty_file", ["data=hf", "data.path=json", "data.data_files={t}/empty.jsonl"],
     ["data.data_files={t}/empty.jsonl: is empty (0 bytes)"]),
    ("hf_glob_of_nothing", ["data=hf", "data.path=json", "data.data_files={t}/none-*.jsonl"],
     ["data.data_files", "no such file"]),
    ("hf_data_files_a_directory", ["data=hf", "data.path=json", "data.data_files={t}/scripted"],
     ["data.data_files={t}/scripted: is a directory"]),
    ("hf_loading_script_dir", ["data=hf", "data.path={t}/scripted"],
     ["data.path={t}/scripted: needs its loading script scripted.py (code)", "data.path=parquet"]),
    ("hf_loading_script_file", ["data=hf", "data.path={t}/scripted/scripted.py"],
     ["data.path={t}/scripted/scripted.py: is a dataset loading script (code)"]),
    ("hf_path_a_loop", ["data=hf", "data.path={t}/loop"], ["data.path={t}/loop: is a symbolic link loop"]),
    ("hf_path_a_file", ["data=hf", "data.path={t}/rows.jsonl"], ["data.path={t}/rows.jsonl: is a file"]),
    ("text_dir_without_text", ["data=text", "data.train_file={t}/no_text"],
     ["data.train_file={t}/no_text: is a directory with no non-empty file in it"]),
    ("text_glob_of_empty_files", ["data=text", "data.train_file={t}/no_text/*.txt"],
     ["data.train_file={t}/no_text/*.txt: no such file, directory or glob match with text in it"]),
    ("json_empty", ["data=json", "data.train_file={t}/empty.jsonl"], ["data.train_file={t}/empty.jsonl: is empty"]),
    ("json_is_a_directory", ["data=json", "data.train_file={t}/scripted"], ["data.train_file={t}/scripted: is a dir"]),
    ("json_is_a_loop", ["data=json", "data.train_file={t}/loop"], ["data.train_file={t}/loop: is a symbolic link"]),
    # class 5: model directories
    ("model_pickled", ["model.name_or_path={t}/models/pickled"],
     ["model.name_or_path={t}/models/pickled: holds pickled weights only (pytorch_model.bin)", "save_pretrained"]),
    ("model_custom_code", ["model.name_or_path={t}/models/custom"],
     ["model.name_or_path={t}/models/custom: ships code of its own", "model.trust_remote_code=true"]),
    ("model_adapter", ["model.name_or_path={t}/models/adapter"],
     ["model.name_or_path={t}/models/adapter: is a peft adapter", "model.name_or_path=/models/base", "merge"]),
    ("model_run_dir", ["model.name_or_path={t}/models/run"], ["did you mean model.name_or_path={t}/models/run/model"]),
    ("model_adapter_merged", ["model.name_or_path={t}/models/merged_adapter"],  # train.merge_adapter=true's model/
     ["model.name_or_path={t}/models/merged_adapter: is a peft adapter; the model merged with it is beside it: "
      "model.name_or_path={t}/models/merged_adapter/merged?"]),
    ("model_is_a_file", ["model.name_or_path={t}/a_file"], ["model.name_or_path={t}/a_file: is a file"]),
    ("model_is_a_loop", ["model.name_or_path={t}/loop"], ["model.name_or_path={t}/loop: is a symbolic link loop"]),
    ("tokenizer_custom_code", ["data.tokenizer={t}/models/tokenizer"],
     ["data.tokenizer={t}/models/tokenizer: ships code of its own (tokenization_x.py"]),
    ("resume_a_loop", ["train.resume={t}/loop"], ["train.resume={t}/loop: is a symbolic link loop"]),
    # a name the filesystem cannot hold (over 255 bytes), below a directory that does not exist yet (stat: ENOENT)
    ("run_dir_name_too_long", ["hydra.run.dir={t}/new/" + "a" * 256], ["is a name longer than the filesystem allows"]),
    ("sweep_job_dir_name_too_long", ["--multirun", "lr=1e-3,2e-3", "hydra.sweep.subdir=${{hydra.job.override_dirname}}",
                                     "model.name=" + "b" * 250], ["invalid sweep (nothing was launched):\n  job #0",
                                                                  "is a name longer than the filesystem allows"]),
    ("resume_a_run_dir", ["train.resume={t}/old_run"],  # the newest by number, not by name (step_9)
     ["train.resume={t}/old_run: holds no manifest.json", "train.resume={t}/old_run/checkpoints/step_10?"]),
    ("resume_its_checkpoints", ["train.resume={t}/old_run/checkpoints"],
     ["(it holds step_10: train.resume={t}/old_run/checkpoints/step_10?)"]),
]


@pytest.mark.parametrize(("args", "fragments"), [c[1:] for c in PATH_MISTAKES], ids=[c[0] for c in PATH_MISTAKES])
def test_a_bad_path_is_refused_before_anything_is_written(args: list[str], fragments: list[str], tree: Path,
                                                          models: Path, cli_refusal) -> None:
    given = [a.format(t=tree) for a in args]
    defaults = [f"hydra.run.dir={tree}/run", f"hydra.sweep.dir={tree}/sweep", f"data.cache_dir={tree}/cache"]
    keys = {a.split("=")[0] for a in given}
    before = sorted(str(p) for p in tree.rglob("*"))
    code, err = cli_refusal([*given, *[d for d in defaults if d.split("=")[0] not in keys]])
    assert code == 2, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment.format(t=tree) in err, f"{fragment.format(t=tree)!r} not in:\n{err}"
    assert sorted(str(p) for p in tree.rglob("*")) == before  # no run, sweep or cache directory, no marker


@pytest.mark.parametrize(("args", "fragment"), [
    (["hydra.run.dir={t}/loop"], "hydra.run.dir={t}/loop: is a symbolic link loop"),
    (["model.name_or_path={t}/models/custom"], "ships code of its own"),
    (["data=hf", "data.path=json", "data.data_files={t}/empty.jsonl"], "is empty (0 bytes)"),
], ids=["run_dir_loop", "model_custom_code", "hf_empty"])
def test_in_a_real_process_exit_2_and_no_code_runs(args: list[str], fragment: str, tree: Path, models: Path) -> None:
    proc = run_cli([*TINY, *[a.format(t=tree) for a in args], f"data.cache_dir={tree}/cache"], cwd=tree, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert fragment.format(t=tree) in proc.stderr and "Traceback" not in proc.stderr
    assert not (tree / MARKER).exists() and not (tree / "cache").exists() and not (tree / "outputs").exists()


def test_what_a_model_directory_may_be(tmp_path: Path) -> None:
    good = _model_dir(tmp_path / "good")
    assert model_dir_problem("model.name_or_path", good, trust_remote_code=False) is None
    sharded = _model_dir(tmp_path / "sharded", weights="model.safetensors.index.json")
    assert model_dir_problem("model.name_or_path", sharded, trust_remote_code=False) is None
    both = _model_dir(tmp_path / "both", files={"pytorch_model.bin": ""})  # safetensors beside a pickle: fine
    assert model_dir_problem("model.name_or_path", both, trust_remote_code=False) is None
    custom = _model_dir(tmp_path / "custom", config={"auto_map": {"AutoModel": "modeling_x.X"}})
    assert "ships code of its own (modeling_x.py" in model_dir_problem("model.name_or_path", custom, False)
    assert model_dir_problem("model.name_or_path", custom, trust_remote_code=True) is None  # the user's own call
    empty = _model_dir(tmp_path / "empty", weights=None)
    assert "holds no weights" in model_dir_problem("model.name_or_path", empty, False)


def test_a_directory_to_be_created_needs_a_directory_above_it(tmp_path: Path) -> None:
    assert dir_out_problem("hydra.run.dir", tmp_path / "new" / "deeper") is None
    (tmp_path / "f").write_text("")
    assert "its parent" in dir_out_problem("hydra.run.dir", tmp_path / "f" / "x" / "y") or \
        "part that is a file" in dir_out_problem("hydra.run.dir", tmp_path / "f" / "x" / "y")
    assert dir_out_problem("hydra.run.dir", tmp_path) is None
    for root in ("/", "/..", "//"):  # what `hydra.run.dir=$UNSET_VAR/` becomes: run files among /bin, /etc...
        assert "is the filesystem's root" in dir_out_problem("hydra.run.dir", root)


def test_data_hf_load_errors_are_one_message(tmp_path: Path) -> None:
    """What `datasets` raises on a file it cannot read (here pyarrow's JSON error inside DatasetGenerationError)
    is a UserError naming data.path and the fix, not a traceback; for a local file builder the fix is the files,
    not the hub's advice (save_to_disk where the hub is reachable)."""
    from omegaconf import OmegaConf

    from llmexp.data.hub import load_split
    from llmexp.errors import UserError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json at all\n{"text": 1}\n')
    d = OmegaConf.create({"path": "json", "data_files": str(bad), "config_name": None})
    with pytest.raises(UserError) as err:
        load_split(d, "train")
    assert "data.path=json: cannot read data.data_files as json (" in str(err.value) and "JSON parse" in str(err.value)
    assert "point data.data_files at json files" in str(err.value) and "hub" not in str(err.value)


@pytest.mark.parametrize(("args", "kind"), [
    (["data=json", "data.train_file={t}/fifo"], "a FIFO"),
    (["data=text", "data.train_file={t}/fifo"], "a FIFO"),
    (["data=hf", "data.path=json", "data.data_files={t}/fifo"], "a FIFO"),
    (["data=json", "data.train_file=/dev/null"], "a device"),
], ids=["json_fifo", "text_fifo", "hf_fifo", "json_device"])
def test_a_fifo_or_device_is_not_a_regular_file_not_an_empty_one(args: list[str], kind: str, tmp_path: Path,
                                                                   cli_refusal) -> None:
    """A FIFO's or a device's size (0) says nothing of what reading it gives: it is refused as what it is, with
    the fix, and never opened (a FIFO without a writer would block)."""
    os.mkfifo(tmp_path / "fifo")
    given = [a.format(t=tmp_path) for a in args]
    code, err = cli_refusal([*given, f"hydra.run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache"])
    key, value = given[-1].split("=", 1)
    assert code == 2 and "Traceback" not in err, err
    assert f"{key}={value}: is not a regular file ({kind}); point it at" in err, err
    assert "empty" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_the_seed_experiment_without_its_files_shows_an_eval_file_for_data_eval_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_refusal) -> None:
    """experiment=seed_llama2_7b names ./data/train.json and ./data/eval.json: each missing one's example is its own."""
    monkeypatch.chdir(tmp_path)
    code, err = cli_refusal(["experiment=seed_llama2_7b", f"hydra.run.dir={tmp_path}/run"])
    assert code == 2 and "e.g. data.train_file=path/to/train.jsonl" in err, err
    assert "e.g. data.eval_file=path/to/eval.jsonl" in err and "data.eval_file=path/to/train" not in err, err


@pytest.mark.parametrize(("source", "says"), [
    ("{{path: json, data_files: {t}/missing.jsonl}}", "data.mix[1].data_files={t}/missing.jsonl: no such file"),
    ("{{path: json, data_files: [{t}/rows.jsonl, {t}/empty.jsonl]}}",
     "data.mix[1].data_files={t}/empty.jsonl: is empty (0 bytes)"),
    ("{{path: json, data_files: {{train: {t}/none-*.jsonl}}}}", "data.mix[1].data_files={t}/none-*.jsonl: no such"),
], ids=["missing", "empty_in_a_list", "glob_of_nothing"])
def test_a_mix_source_s_data_files_are_checked_as_data_data_files_are(source: str, says: str, tree: Path,
                                                                      cli_refusal) -> None:
    """Each `data.mix` entry's files are looked at before anything is written, named by the entry's key and with
    the entry's own `path` in the fix, not found only when `datasets` loads them (with advice about the hub)."""
    mix = f"data.mix=[{{path: json, data_files: {tree}/rows.jsonl}}, {source.format(t=tree)}]"
    before = sorted(str(p) for p in tree.rglob("*"))
    code, err = cli_refusal(["data=hf", mix, f"hydra.run.dir={tree}/run", f"data.cache_dir={tree}/cache"])
    assert code == 2 and "Traceback" not in err, err
    assert says.format(t=tree) in err and "files for data.mix[1].path=json" in err, err
    assert "data.mix[0]" not in err
    assert sorted(str(p) for p in tree.rglob("*")) == before


def _checkpoint(root: Path) -> Path:
    """A checkpoint as `llmexp.checkpoint.store` saves one: two files and the manifest listing them."""
    from llmexp.checkpoint.store import save_checkpoint

    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"\1" * 64)
        (tmp / "trainer_state.json").write_text("{}")

    return save_checkpoint(root / "checkpoints", 2, write, keep=1)


@pytest.mark.parametrize(("damage", "says"), [
    (lambda c: os.truncate(c / "model.safetensors", 10), "model.safetensors: 10 bytes, the manifest says 64"),
    (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json: missing (listed in the manifest)"),
    (lambda c: (c / "manifest.json").write_text('{"files": '), "manifest.json: unreadable manifest"),
    (lambda c: (c / "manifest.json").write_text('{"files": {"a": {"size": "8"}}}'), "malformed manifest"),
], ids=["truncated", "missing_file", "torn_manifest", "manifest_of_strings"])
def test_a_damaged_resume_checkpoint_is_refused_before_the_run_directory_is_made(
        damage: Callable[[Path], object], says: str, tmp_path: Path, cli_refusal) -> None:
    """`train.resume=PATH` to a checkpoint whose files are not what its manifest says (a copy cut short): refused
    as the loader would refuse it, but before anything is written, naming the key and the ways out."""
    checkpoint = _checkpoint(tmp_path / "old")
    args = [f"train.resume={checkpoint}", f"data.cache_dir={tmp_path}/cache"]
    with pytest.raises(Launched):  # whole, it passes the check
        cli_refusal([*args, f"hydra.run.dir={tmp_path}/whole"])
    damage(checkpoint)
    code, err = cli_refusal([*args, f"hydra.run.dir={tmp_path}/run"])
    assert code == 2 and "Traceback" not in err, err
    assert f"train.resume={checkpoint}: the checkpoint is damaged (" in err and says in err, err
    assert "train.resume=auto" in err and "train.resume=never" in err and "another checkpoint" in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
