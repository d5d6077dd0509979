"""Security: secrets never reach run files, only allow-listed `_target_`s, no path escapes, pinned remote code.

The end-to-end test trains for real (tiny model, 2 steps, wandb offline) with canary secrets in the
environment and on the command line, then greps every byte the run left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import DictConfig

from llmexp.config import security
from llmexp.errors import UserError
from llmexp.rundir import redact
from llmexp.rundir.names import safe_name
from tests.conftest import Launched, compose
from tests.test_bad_input import run_llmexp

# ---------------------------------------------------------------- secrets


@pytest.mark.parametrize("key", ["api_key", "WANDB_API_KEY", "HF_TOKEN", "hf_token", "token", "AWS_SECRET_ACCESS_KEY",
                                 "db_password", "MY_SERVICE_SECRET", "client_secret", "private_key", "GITHUB_TOKEN"])
def test_credential_names_are_secret(key: str) -> None:
    assert redact.is_secret_key(key)


@pytest.mark.parametrize("key", ["tokenizer", "pad_token", "eos_token", "num_key_value_heads", "max_length", "lr",
                                 "tokens_per_sec", "_target_", "monkey", "name_or_path", "cache_dir", "HOME",
                                 "data_cache_key"])
def test_ordinary_names_are_not_secret(key: str) -> None:
    assert not redact.is_secret_key(key)


def test_secret_env_values_pick_credentials_only() -> None:
    env = {"HF_TOKEN": "hf_value_123456", "WANDB_API_KEY": "wandbvalue", "HOME": "/root", "SHORT_TOKEN": "1",
           "LLMEXP_SECRET_0": "from-cli-xyz"}
    assert redact.secret_env_values(env) == ["hf_value_123456", "from-cli-xyz", "wandbvalue"]


def test_scrub_redacts_keys_env_values_and_token_shapes() -> None:
    data = {"logger": {"api_key": "abc", "project": "p"}, "note": "key is s3cr3t-value inside",
            "list": ["hf_" + "a" * 30, 3, None], "entity": None, "password": ""}
    clean = redact.scrub(data, secrets=["s3cr3t-value"])
    assert clean == {"logger": {"api_key": "***", "project": "p"}, "note": "key is *** inside",
                     "list": ["***", 3, None], "entity": None, "password": ""}
    assert data["logger"]["api_key"] == "abc"  # a copy: the run still has its key


def test_scrub_overrides_redacts_secret_keys_and_values() -> None:
    overrides = ["lr=0.1", "+logger.api_key=abc", "+x.note=has sk-" + "b" * 24, "~model.hf_token", "data.name=json"]
    assert redact.scrub_overrides(overrides, secrets=[]) == [
        "lr=0.1", "+logger.api_key=***", "+x.note=has ***", "~model.hf_token", "data.name=json"]


def test_redact_overrides_moves_secrets_into_private_env_vars() -> None:
    env: dict[str, str] = {"HF_TOKEN": "hf_envsecret_value"}
    args = ["--multirun", "lr=1,2", "+cluster.additional_parameters.api_token='q w'", "+a.note=hf_envsecret_value",
            "+a.ref=${oc.env:HF_TOKEN}", "-cd", "/tmp"]
    out = redact.redact_overrides(args, environ=env)
    assert out == ["--multirun", "lr=1,2", "+cluster.additional_parameters.api_token=${oc.env:LLMEXP_SECRET_0}",
                   "+a.note=${oc.env:LLMEXP_SECRET_1}", "+a.ref=${oc.env:HF_TOKEN}", "-cd", "/tmp"]
    assert env["LLMEXP_SECRET_0"] == "q w" and env["LLMEXP_SECRET_1"] == "hf_envsecret_value"


SK = "sk-" + "c" * 24


def test_a_secret_in_a_list_or_dict_override_is_lifted_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret inside a list or dict override gets a variable of its own: the value stays a list (prompts, not
    characters) or a dict (keyword arguments, not a string the optimizer's builder fails on)."""
    env: dict[str, str] = {"HF_TOKEN": "hf_envsecret_value"}
    out = redact.redact_overrides([f"train.sample_prompts=[hello,{SK}]",
                                   f"++optimizer.kwargs={{foo: {SK}, bar: 'x hf_envsecret_value'}}"], environ=env)
    assert out == ["train.sample_prompts=[hello,${oc.env:LLMEXP_SECRET_0}]",
                   "++optimizer.kwargs={foo: ${oc.env:LLMEXP_SECRET_1}, bar: 'x ${oc.env:LLMEXP_SECRET_2}'}"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = compose(out, tmp_path / "run")
    assert list(cfg.train.sample_prompts) == ["hello", SK]
    assert dict(cfg.optimizer.kwargs) == {"foo": SK, "bar": "x hf_envsecret_value"}


@pytest.mark.parametrize(("override", "message"), [
    (f"logger.tags=[ok,{SK}]", "logger.tags[1]: holds a secret"),
    (f"train.sample_prompts=[hello,'',{SK}]", "train.sample_prompts[1]: must not be empty"),
    ("train.sample_prompts=${oc.env:HOME}", "train.sample_prompts: must be a list, not a string"),
])
def test_a_list_override_with_a_secret_is_judged_item_by_item(override: str, message: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, cli_refusal) -> None:
    for n in range(2):  # the variables the command line's secrets are lifted into, unset again after the test
        monkeypatch.setenv(f"{redact.SECRET_ENV_PREFIX}{n}", "")
    monkeypatch.chdir(tmp_path)
    code, err = cli_refusal([override, "logger=wandb"])
    assert code == 2 and message in err and SK not in err, err
    assert not list(tmp_path.iterdir())


def test_log_filter_scrubs_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    monkeypatch.setenv("MY_SERVICE_PASSWORD", "canary-log-password")
    logger = logging.getLogger("llmexp.test_security")
    logger.propagate = False
    handler = logging.FileHandler(tmp_path / "job.log")
    logger.addHandler(handler)
    try:
        redact.install_log_filter(logger)
        logger.warning("connecting with %s", "canary-log-password")
    finally:
        handler.close()
        logger.removeHandler(handler)
    assert (tmp_path / "job.log").read_text() == "connecting with ***\n"


def test_cfg_job_prints_no_secret(tmp_path: Path) -> None:
    proc = run_llmexp(["--cfg", "job", "+cluster.additional_parameters.api_token=CANARY_CFG_JOB_77"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "api_token: ${oc.env:LLMEXP_SECRET_0}" in proc.stdout
    assert "CANARY_CFG_JOB_77" not in proc.stdout + proc.stderr


def test_rejected_secret_override_is_not_echoed(tmp_path: Path) -> None:
    proc = run_llmexp(["+logger.api_key=CANARY_REJECTED_55", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2 and "logger.api_key: no such key" in proc.stderr
    assert "CANARY_REJECTED_55" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


def test_scrub_yaml_file_redacts_and_keeps_interpolations(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("cluster:\n  additional_parameters:\n    api_token: abc123\n    ref: ${oc.env:HF_TOKEN}\n"
                      "data:\n  cache_dir: ${oc.env:HOME}/.cache\n")
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text("- lr=0.1\n- +cluster.additional_parameters.api_token=abc123\n")
    assert redact.scrub_yaml_file(config) and redact.scrub_yaml_file(overrides)
    assert config.read_text() == ("cluster:\n  additional_parameters:\n    api_token: '***'\n"
                                  "    ref: ${oc.env:HF_TOKEN}\ndata:\n  cache_dir: ${oc.env:HOME}/.cache\n")
    assert overrides.read_text() == "- lr=0.1\n- +cluster.additional_parameters.api_token=***\n"
    assert not redact.scrub_yaml_file(config)  # nothing left to redact: the file is not rewritten


ENV_CANARIES = {"WANDB_API_KEY": "canarywandb0123456789abcdef0123456789abcd",
                "HF_TOKEN": "hf_CanaryHubToken0123456789abc", "MY_SERVICE_PASSWORD": "canary-env-password-31",
                "AWS_SECRET_ACCESS_KEY": "canaryAwsSecret/31x+y"}
CLI_CANARY = "CANARY-cli-api-token-93"
SHAPED_CANARY = "sk-canaryShapedValue0123456789ab"


@pytest.mark.slow
def test_canary_secrets_never_reach_any_file_of_a_real_run(tmp_path: Path) -> None:
    """A one-job sweep (the job runs in its own process, like every sweep job) with wandb offline,
    checkpoints and the report; secrets come from the environment and from the command line."""
    from tests.conftest import TINY

    sweep = tmp_path / "sweep"
    args = ["--multirun", *TINY, "train.max_steps=2", "train.eval_steps=2", "train.save_steps=1",
            "logger=wandb", "logger.mode=offline", f"hydra.sweep.dir={sweep}",
            f"+cluster.additional_parameters.api_token={CLI_CANARY}",
            "+cluster.additional_parameters.hub=${oc.env:HF_TOKEN}",
            f"+cluster.additional_parameters.comment={SHAPED_CANARY}",
            "+cluster.additional_parameters.marker=VISIBLE_MARKER_4711"]
    cache = os.environ.get("LLMEXP_CACHE", str(tmp_path / "cache"))  # the session's: the tokenizer is trained once
    proc = run_llmexp(args, tmp_path, env={**ENV_CANARIES, "WANDB_MODE": "offline", "LLMEXP_CACHE": cache})
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = [p for p in sweep.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.yaml", "overrides.yaml", "hydra.yaml", "metrics.jsonl", "summary.json", "report.md",
            "llmexp.log", "sweep_summary.json", "trainer_state.json", "optimizer.pt"} <= names, names
    assert any(p.suffix == ".wandb" for p in files) and any(p.parent.name == "checkpoints" for p in sweep.rglob("*"))
    blobs = {p: p.read_bytes() for p in files}
    canaries = [*ENV_CANARIES.values(), CLI_CANARY, SHAPED_CANARY]
    for path, blob in blobs.items():
        for canary in canaries:
            assert canary.encode() not in blob, f"{canary} leaked into {path.relative_to(tmp_path)}"
    for canary in canaries:
        assert canary not in proc.stdout + proc.stderr, f"{canary} leaked to the console"
    # positive control: a non-secret value from the same override list does reach those files
    seen = {p.name for p, blob in blobs.items() if b"VISIBLE_MARKER_4711" in blob}
    assert {"config.yaml", "overrides.yaml"} <= seen and any(n.endswith(".wandb") for n in seen), seen


def _sinks_scrub_is_security_scrub() -> bool:
    from llmexp.monitor import sinks
    return sinks.scrub is redact.scrub


@pytest.mark.xfail(condition=not _sinks_scrub_is_security_scrub(), strict=True,
                   reason="llmexp.monitor.sinks keeps its own scrub(), which misses env values")
def test_wandb_config_never_holds_an_env_secret_the_config_references(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`+x.ref=${oc.env:MY_SERVICE_PASSWORD}` resolves to the secret in the config wandb receives; neither
    the key name nor the value's shape gives it away, only its being an env secret's value."""
    from llmexp.config.schema import LoggerConfig
    from llmexp.monitor.sinks import WandbSink

    monkeypatch.setenv("MY_SERVICE_PASSWORD", "canary-env-password-31")
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = {"cluster": {"additional_parameters": {"ref": "canary-env-password-31", "marker": "VISIBLE_MARKER_4712"}}}
    sink = WandbSink(tmp_path, config, "default", LoggerConfig(name="wandb", mode="offline", project="llmexp"))
    sink.log({"event": "train", "step": 1, "loss": 1.0})
    sink.close()
    blobs = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    assert any(b"VISIBLE_MARKER_4712" in blob for blob in blobs)  # the config did reach wandb's files
    assert not any(b"canary-env-password-31" in blob for blob in blobs)


# ---------------------------------------------------------------- _target_


@pytest.mark.parametrize("target", ["builtins.open", "os.system", "subprocess.Popen", "hydra.utils.instantiate",
                                    "torch.optim.__builtins__", "torch.optim..AdamW", "${oc.env:X}", "torch", 42])
def test_disallowed_targets(target: object) -> None:
    assert security.target_errors({"optimizer": {"_target_": target}})


@pytest.mark.parametrize("target", ["torch.optim.AdamW", "bitsandbytes.optim.AdamW8bit", "torch.optim.SGD"])
def test_allowed_targets(target: str) -> None:
    assert security.target_errors({"optimizer": {"_target_": target}}) == []


def test_every_target_anywhere_is_scanned() -> None:
    cfg = {"optimizer": {"_target_": "torch.optim.AdamW", "kwargs": {"x": {"_target_": "os.system"}}},
           "cluster": {"additional_parameters": {"list": [{"_target_": "torch.optim.SGD"}]}}}
    errors = security.target_errors(cfg)
    assert len(errors) == 2
    assert errors[0].startswith("optimizer.kwargs.x._target_: 'os.system'")
    assert errors[1].startswith("cluster.additional_parameters.list.0._target_:")  # allowed class, wrong place


def test_located_object_must_be_defined_under_the_allow_list() -> None:
    import torch

    security.check_located(torch.optim.AdamW, "torch.optim.AdamW", "optimizer._target_", base=torch.optim.Optimizer)
    with pytest.raises(UserError, match=r"posix\.system"):  # a detour through a module's own `import os`
        security.check_located(os.system, "torch.optim.optimizer.os.system", "k")
    with pytest.raises(UserError, match="not one of the allowed classes"):  # compared by identity
        security.check_located(torch.optim.lr_scheduler.LambdaLR, "torch.optim.lr_scheduler.LambdaLR", "k",
                               base=torch.optim.Optimizer)
    with pytest.raises(UserError, match="not one of the allowed optimizer classes"):  # refused before any import
        security.import_target("optimizer._target_", "torch.optim.optimizer.os.system")
    assert security.import_target("optimizer._target_", "torch.optim.SGD", base=torch.optim.Optimizer) is \
        torch.optim.SGD


def test_target_from_a_yaml_file_is_refused(tmp_path: Path) -> None:
    """A `_target_` the command line never saw (a user's YAML via --config-dir) is caught by validate."""
    conf = tmp_path / "extra" / "experiment"
    conf.mkdir(parents=True)
    (conf / "evil.yaml").write_text("# @package _global_\noptimizer:\n  kwargs:\n    x:\n"
                                    "      _target_: builtins.exec\n      _args_: ['open(\"/tmp/pwned\", \"w\")']\n")
    proc = run_llmexp(["--config-dir", str(tmp_path / "extra"), "experiment=evil",
                       f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "optimizer.kwargs.x._target_: 'builtins.exec'" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("target", "message"), [
    ("llmexp.sweep.local.subprocess.Popen", "resolves to 'subprocess.Popen'"),  # a detour through `import subprocess`
    ("llmexp.rundir.files.write_json_atomic", "resolves to 'llmexp.rundir.files.write_json_atomic'"),
    ("builtins.exec", "is not one of the allowed classes here"),
])
def test_hydra_side_targets_are_resolved_and_compared_by_identity(target: str, message: str) -> None:
    problems = dict(security.config_problems(_composed([f"+hydra.callbacks.x._target_={target}"])))
    assert message in problems["hydra.callbacks.x._target_"]
    redact = "+hydra.callbacks.x._target_=llmexp.rundir.redact.RedactRunFiles"
    assert security.config_problems(_composed([redact])) == []


def _composed(overrides: list[str], multirun: bool = False) -> DictConfig:
    """The config `python -m llmexp OVERRIDES` composes (Hydra's own compose, hydra node included)."""
    from hydra import compose, initialize_config_dir
    from hydra.types import RunMode
    from omegaconf import open_dict

    from llmexp.config.schema import register_configs
    from llmexp.config.tree import conf_dir, register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    return cfg


def test_hydra_callbacks_and_logging_classes_in_user_yaml_are_refused(tmp_path: Path) -> None:
    """Hydra instantiates `hydra.callbacks` and builds logging handlers before any job code runs: the
    composed config is checked before Hydra gets it, naming the YAML file each key came from."""
    extra = tmp_path / "extra"
    (extra / "experiment").mkdir(parents=True)
    (extra / "hydra" / "job_logging").mkdir(parents=True)
    (extra / "experiment" / "evil.yaml").write_text(
        "# @package _global_\nhydra:\n  callbacks:\n    evil:\n      _target_: llmexp.sweep.local.subprocess.Popen\n"
        f"      args: [touch, {tmp_path / 'pwned'}]\n")
    (extra / "hydra" / "job_logging" / "evil.yaml").write_text(
        f"version: 1\nhandlers:\n  x:\n    class: subprocess.Popen\n    args: [touch, {tmp_path / 'pwned'}]\n"
        f"filters:\n  f:\n    (): builtins.open\n    file: {tmp_path / 'pwned'}\n    mode: w\n"
        "root:\n  handlers: [x]\n")
    proc = run_llmexp(["-cd", str(extra), "experiment=evil", "hydra/job_logging=evil",
                       f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert (f"{extra / 'experiment' / 'evil.yaml'}: hydra.callbacks.evil._target_: "
            "'llmexp.sweep.local.subprocess.Popen' resolves to 'subprocess.Popen'") in proc.stderr
    assert (f"{extra / 'hydra' / 'job_logging' / 'evil.yaml'}: hydra.job_logging.handlers.x.class: "
            "'subprocess.Popen' is not one of logging's own classes") in proc.stderr
    assert "hydra.job_logging.filters.f.(): logging factories ('()')" in proc.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- one test per route class (issue 14)
# Each runs the real CLI in tmp_path with a canary that the refused config would create (a file opened
# by `builtins.open`, a `touch` run through `subprocess.run`, a directory Hydra would write) and checks
# exit 2, the key and its origin in the message, and that neither the canary nor any directory appears.


def _open_canary(canary: Path) -> str:
    """A `_target_` node that creates `canary` when instantiated."""
    return f"{{_target_:builtins.open,_args_:[{canary},w]}}"


def _refused(tmp_path: Path, args: list[str], fragments: list[str], env: dict[str, str] | None = None,
             canary: Path | None = None) -> None:
    before = {p.name for p in tmp_path.iterdir()}
    proc = run_llmexp([*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                      tmp_path, env)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
    assert canary is None or not canary.exists(), f"{canary} was created"
    assert {p.name for p in tmp_path.iterdir()} == before, "a file or directory was created"


@pytest.mark.parametrize("override", [
    "+hydra.callbacks={{evil:{node}}}",
    "+hydra.callbacks.evil={node}",
    "++hydra.job_logging.handlers={{x:{{class:logging.FileHandler,filename:{canary}}}}}",
    "++hydra.job_logging.handlers.x={{class:logging.handlers.SocketHandler,host:localhost,port:9}}",
    "hydra.hydra_logging.handlers.console.stream=ext://builtins.print",
])
def test_route_dict_valued_hydra_overrides(override: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    arg = override.format(node=_open_canary(canary), canary=canary)
    _refused(tmp_path, [arg], ["command line: hydra."], canary=canary)


def _evil_tree(root: Path, canary: Path) -> Path:
    """A config dir whose experiment adds a Hydra callback, and a group for package overrides."""
    (root / "experiment").mkdir(parents=True)
    (root / "evilgroup").mkdir()
    (root / "experiment" / "evil.yaml").write_text(
        f"# @package _global_\nhydra:\n  callbacks:\n    evil:\n      _target_: builtins.open\n"
        f"      _args_: [{canary}, w]\n")
    (root / "evilgroup" / "cb.yaml").write_text(f"_target_: builtins.open\n_args_: [{canary}, w]\n")
    return root


@pytest.mark.parametrize("route", [
    ["hydra.searchpath=[{dir}]", "experiment=evil"],  # a search path without a scheme
    ["hydra.searchpath=[file://{dir}]", "experiment=evil"],
    ["-cd", "{dir}", "experiment=evil"],
    ["--config-d", "{dir}", "experiment=evil"],  # an abbreviation argparse accepts
    ["--config-dir={dir}", "experiment=evil"],
    ["--config-d={dir}", "+evilgroup@hydra.callbacks.x=cb"],  # a package override
    ["hydra.searchpath=[{dir}]", "+evilgroup@hydra.callbacks.x=cb"],
])
def test_route_yaml_from_every_config_source(route: list[str], tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    tree = _evil_tree(tmp_path.parent / f"{tmp_path.name}-conf", canary)
    args = [a.format(dir=tree) for a in route]
    origin = tree / ("experiment/evil.yaml" if "experiment=evil" in args else "evilgroup/cb.yaml")
    _refused(tmp_path, args, [f"{origin}: hydra.callbacks.", "'builtins.open'"], canary=canary)


def test_route_config_name_abbreviation_loads_a_checked_primary_config(tmp_path: Path) -> None:
    """`--config-n` (argparse's abbreviation of --config-name) with a primary config from -cd."""
    canary = tmp_path / "canary"
    tree = tmp_path.parent / f"{tmp_path.name}-conf"
    tree.mkdir()
    (tree / "mine.yaml").write_text(f"defaults:\n  - config\n  - _self_\nhydra:\n  callbacks:\n    evil:\n"
                                    f"      _target_: builtins.open\n      _args_: [{canary}, w]\n")
    _refused(tmp_path, ["-cd", str(tree), "--config-n", "mine"], [f"{tree / 'mine.yaml'}: hydra.callbacks.evil"],
             canary=canary)


def test_route_package_search_path_imports_no_foreign_package(tmp_path: Path) -> None:
    """`pkg://X` makes Hydra import X while composing, before any check of the composed config could run."""
    canary = tmp_path / "canary"
    packages = tmp_path.parent / f"{tmp_path.name}-pkgs"
    (packages / "evilpkg").mkdir(parents=True)
    (packages / "evilpkg" / "__init__.py").write_text(f"open({str(canary)!r}, 'w').close()\n")
    _refused(tmp_path, ["hydra.searchpath=[pkg://evilpkg]"], ["hydra.searchpath: pkg://evilpkg would import"],
             env={"PYTHONPATH": os.pathsep.join([str(packages), os.environ.get("PYTHONPATH", "")])}, canary=canary)


@pytest.mark.parametrize("target", ["llmexp.sweep.local.subprocess.run", "llmexp.sweep.local.os.system",
                                    "llmexp.config.security.os.system"])
def test_route_attribute_walk_targets(target: str, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    args = [f"+hydra.callbacks.x={{_target_:{target},_args_:[[touch,{canary}]]}}"]
    _refused(tmp_path, args, ["command line: hydra.callbacks.x._target_", f"'{target}' resolves to"], canary=canary)


def test_route_attribute_walk_optimizer_target(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    _refused(tmp_path, ["optimizer._target_=llmexp.model.build.importlib.import_module"],
             ["command line: optimizer._target_", "not one of the allowed optimizer classes"], canary=canary)


class _Planted:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.canary), "w"))


@pytest.mark.parametrize("flag", ["--experimental-rerun", "--experimental-r"])
def test_route_experimental_rerun_is_refused(flag: str, tmp_path: Path) -> None:
    import pickle

    canary = tmp_path / "canary"
    planted = tmp_path / "config.pickle"
    planted.write_bytes(pickle.dumps(_Planted(canary)))
    _refused(tmp_path, [flag, str(planted)], ["--experimental-rerun", "unpickles"], canary=canary)


@pytest.mark.parametrize("name", ["CC", "CXX", "LD_PRELOAD", "PATH", "PYTHONPATH", "TORCH_EXTENSIONS_DIR"])
def test_route_env_set_of_executables(name: str, tmp_path: Path) -> None:
    evil = tmp_path / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {tmp_path / 'canary'}\n")
    evil.chmod(0o755)
    _refused(tmp_path, [f"+hydra.job.env_set.{name}={evil}"], [f"command line: hydra.job.env_set.{name}"],
             canary=tmp_path / "canary")


@pytest.mark.parametrize(("args", "key"), [
    (["hydra.output_subdir=${oc.env:LLMEXP_TEST_ESCAPE}"], "hydra.output_subdir"),
    (["hydra.job.name=${oc.env:LLMEXP_TEST_ESCAPE}"], "hydra.job.name"),
    (["--multirun", "hydra.sweep.subdir=${oc.env:LLMEXP_TEST_ESCAPE}"], "hydra.sweep.subdir"),
    (["hydra.job_logging.handlers.file.filename=${oc.env:LLMEXP_TEST_ESCAPE}/x.log"],
     "hydra.job_logging.handlers.file.filename"),
])
def test_route_interpolations_escaping_the_directory(args: list[str], key: str, tmp_path: Path) -> None:
    escape = tmp_path.parent / f"{tmp_path.name}-escaped"
    _refused(tmp_path, args, [f"command line: {key}"], env={"LLMEXP_TEST_ESCAPE": f"../../{escape.name}"},
             canary=escape)


def test_env_copy_of_this_environment_passes_and_env_set_of_path_does_not() -> None:
    copied = _composed(["hydra.job.env_copy=[PATH,HOME]", "+hydra.job.env_set.WANDB_MODE=x"])
    assert os.environ["PATH"] == copied.hydra.job.env_set.PATH  # (Hydra copies it into env_set)
    assert security.config_problems(copied) == []
    assert [k for k, _ in security.config_problems(_composed(["+hydra.job.env_set.PATH=/tmp/evil"]))] == [
        "hydra.job.env_set.PATH"]


def test_the_default_config_passes_the_check() -> None:
    assert security.config_problems(_composed([])) == []
    assert security.config_problems(_composed(["cluster=slurm"], multirun=True)) == []


def test_the_launcher_configs_from_the_plugin_pass_and_a_foreign_launcher_target_does_not() -> None:
    """The launcher configs come from the plugin's ConfigStore entries (issue 19); their `_target_`s are the
    allow-listed classes, in both spellings of a setting, and anything else at `hydra.launcher._target_` is refused."""
    for overrides in (["hydra.launcher.max_parallel=2"], ["cluster=slurm", "hydra.launcher.timeout_min=5"],
                      ["hydra/launcher=llmexp_slurm"], ["hydra/launcher=basic"]):
        assert security.config_problems(_composed(overrides, multirun=True)) == [], overrides
    problems = dict(security.config_problems(_composed(["hydra.launcher._target_=builtins.exec"], multirun=True)))
    assert "is not one of the allowed classes here" in problems["hydra.launcher._target_"]
    escaped = dict(security.config_problems(_composed(["cluster=slurm", "hydra.launcher.submitit_folder=/etc/x"],
                                                      multirun=True)))
    assert "hydra.launcher.submitit_folder" in escaped


def test_hydra_private_api_this_cli_follows_is_unchanged() -> None:
    """The CLI composes and checks each config before `@hydra.main` composes it again: its Compose API is
    initialized with the search path `hydra._internal.utils._run_hydra` of Hydra 1.3 builds, and with Hydra's
    own argument parser (`llmexp.cli.hydra_internals`). After a Hydra upgrade this fails, and that file must be
    compared with the new `_run_hydra` before the hash is updated."""
    import hashlib
    import inspect

    import hydra
    from hydra._internal import utils

    assert hydra.__version__ == "1.3.8"
    digest = hashlib.sha256(inspect.getsource(utils._run_hydra).encode()).hexdigest()
    assert digest == RUN_HYDRA_SHA256, digest


RUN_HYDRA_SHA256 = "8442d5abfa70fc1d420c452247c93082267cd646af8cdb8f271d42b66589dbbd"


# ---------------------------------------------------------------- paths


@given(st.text(max_size=300))
def test_safe_name_is_one_harmless_path_component(text: str) -> None:
    name = safe_name(text)
    assert name and len(name) <= 120
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert name not in (".", "..") and not name.startswith(".")


@pytest.mark.parametrize(("value", "problem"), [("../x", "'..'"), ("a/../../b", "'..'"), ("..\\x", "'..'"),
                                                ("/etc", "absolute"), ("~/x", "absolute"), ("a\x00b", "NUL")])
def test_path_problems(value: str, problem: str) -> None:
    assert problem in (security.path_problem(value) or "")


@pytest.mark.parametrize("value", ["run1", "a/b", "lr=0.1,batch_size=4", "a..b"])
def test_plain_relative_paths_pass(value: str) -> None:
    assert security.path_problem(value) is None


# ---------------------------------------------------------------- remote code


def _model(**fields: object) -> object:
    from omegaconf import OmegaConf

    from llmexp.config.schema import ModelConfig

    return OmegaConf.merge(OmegaConf.structured(ModelConfig), fields)


def test_remote_code_is_off_by_default() -> None:
    from llmexp.config.schema import ModelConfig

    assert ModelConfig().trust_remote_code is False


@pytest.mark.parametrize(("fields", "ok"), [
    ({"trust_remote_code": True, "name_or_path": "org/model"}, False),
    ({"trust_remote_code": True, "name_or_path": "org/model", "revision": "main"}, False),
    ({"trust_remote_code": True, "name_or_path": "org/model", "revision": "v1.0"}, False),
    ({"trust_remote_code": True, "name_or_path": "org/model", "revision": "0123abc"}, False),
    ({"trust_remote_code": True, "name_or_path": "org/model", "revision": "0123456789abcdef0123456789abcdef01234567"},
     True),
    ({"trust_remote_code": True}, False),
    ({"trust_remote_code": True, "name_or_path": "./my-local-model"}, True),
    ({"trust_remote_code": False, "name_or_path": "org/model", "revision": "main"}, True),
])
def test_remote_code_needs_a_pinned_commit(fields: dict[str, object], ok: bool) -> None:
    from llmexp.config.security import remote_code_errors

    assert (remote_code_errors(_model(**fields)) == []) is ok


def test_run_dir_is_the_users_explicit_choice_but_ids_and_names_are_sanitized(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hydra.run.dir` / `hydra.sweep.dir` name the output directory itself, so any path is accepted (as
    with `-o DIR`); values that become components below it are refused or made safe."""
    from llmexp.rundir.names import run_id

    assert security.config_problems(_composed(["hydra.run.dir=../../elsewhere", "hydra.sweep.dir=/abs/sweep"])) == []
    for key in ("hydra.job.name", "hydra.output_subdir"):
        assert key in dict(security.config_problems(_composed([f"{key}=../up"])))
    assert "hydra.sweep.subdir" in dict(security.config_problems(_composed(["hydra.sweep.subdir=../up"], True)))
    monkeypatch.setenv("LLMEXP_RUN_ID", "../../etc/passwd")  # (the environment cannot hold NUL bytes)
    assert run_id() == "etc_passwd"


PRIVATE_HYDRA_APIS: dict[str, set[str]] = {
    "hydra._internal.utils": {"get_args_parser", "create_automatic_config_search_path",
                              "detect_calling_file_or_module_from_task_function", "detect_task_name"},
    "hydra._internal.hydra": {"Hydra"},
    "hydra._internal.core_plugins.importlib_resources_config_source": {"ImportlibResourcesConfigSource"},
    "hydra._internal.sources_registry": {"SourcesRegistry"},
}
"""Hydra 1.3's private names llmexp imports, each where no public API does the job (its module docstring says
why): Hydra's argument parser, the Compose API on `@hydra.main`'s search path, and `pkg://` sources restricted."""
PRIVATE_HYDRA_MODULE = "llmexp/cli/hydra_internals.py"
"""The one module that imports them."""


def test_every_private_hydra_api_llmexp_imports_is_listed_and_still_there() -> None:
    """A new private import must be added above (with its reason at the import); a Hydra upgrade that drops
    one fails here, by name, rather than somewhere inside a run."""
    import ast
    import importlib

    root = Path(__file__).resolve().parents[1]
    used: set[tuple[str, str]] = set()
    for path in [*(root / "llmexp").rglob("*.py"), *(root / "hydra_plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hydra._internal"):
                assert path.relative_to(root).as_posix() == PRIVATE_HYDRA_MODULE, path
                used |= {(node.module, alias.name) for alias in node.names}
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("hydra._internal") for a in node.names), path
    listed = {(module, name) for module, names in PRIVATE_HYDRA_APIS.items() for name in names}
    assert used and used <= listed, sorted(used - listed)
    for module, name in sorted(listed):
        assert hasattr(importlib.import_module(module), name), f"Hydra no longer has {module}.{name}"


# ---------------------------------------------------------------- code in a harness task folder

CANARY_MODULE = "import pathlib\npathlib.Path({path!r}).write_text('ran')\ndef process(docs):\n    return docs\n"


def _task_folder(root: Path, body: str, canary: Path) -> Path:
    """A harness task folder whose `utils.py` writes `canary` when imported."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "utils.py").write_text(CANARY_MODULE.format(path=str(canary)))
    (root / "t.yaml").write_text("task: t\ndataset_path: json\noutput_type: multiple_choice\n" + body)
    return root


def _harness_args(folder: Path, *extra: str) -> list[str]:
    return ["eval=lm_eval", "eval.lm_eval.tasks=[t]", f"eval.lm_eval.include_path={folder}",
            "eval.lm_eval.include_defaults=false", *extra]


@pytest.mark.parametrize(("body", "named"), [
    ("process_docs: !function utils.process\n", "t.yaml:4: `process_docs: !function utils.process`"),
    ("include: ../elsewhere/base.yaml\n", "base.yaml:1: `process_docs: !function utils.process`"),
    ("doc_to_text: \"{{ lipsum.__globals__['os'].popen('true').read() }}\"\n", "reads the private attribute"),
    ("doc_to_text: \"{{ question|attr('__class__') }}\"\n", "uses the attr filter"),
], ids=["function", "include-chain", "jinja-globals", "jinja-attr"])
def test_a_task_folder_runs_no_code_without_trust_code(body: str, named: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, cli_refusal) -> None:
    """Issue 40, security 1: a `!function` (in the folder's YAML or in one it includes from elsewhere) or a Jinja
    template that reaches Python is refused before anything is written, naming the file, line and the opt-in key;
    the canary module never runs. With `eval.lm_eval.trust_code=true` the same command is not refused."""
    canary = tmp_path / "CANARY"
    _task_folder(tmp_path / "elsewhere", "", canary).joinpath("base.yaml").write_text(
        "process_docs: !function utils.process\n")
    folder = _task_folder(tmp_path / "tasks", body, canary)
    monkeypatch.chdir(tmp_path)
    code, err = cli_refusal(_harness_args(folder))
    assert code == 2 and named in err and "eval.lm_eval.trust_code=true" in err, err
    assert not canary.exists() and not (tmp_path / "outputs").exists()
    with pytest.raises(Launched):  # trusted: past every check, to the launch
        cli_refusal(_harness_args(folder, "eval.lm_eval.trust_code=true"))
    assert not canary.exists()  # checking never imports the module


def test_a_plain_task_folder_and_the_harness_own_tasks_need_no_trust(tmp_path: Path) -> None:
    """Field reads in templates are data, and an `include:` of a YAML in the installed harness's task tree is code
    the user installed (not followed); a damaged task YAML is named with its line."""
    import lm_eval

    from llmexp.machine.task_code import code_in_task_dir

    installed = next(Path(lm_eval.__file__).parent.joinpath("tasks").rglob("*.yaml"))
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "t.yaml").write_text(f"task: t\ninclude: {installed}\ndoc_to_text: \"{{{{question}}}} {{{{ "
                                   "choices.text[0] }}\"\ndoc_to_target: \"{{answerKey}}\"\n")
    assert code_in_task_dir(folder) == []
    (folder / "bad.yaml").write_text("task: b\ndoc_to_text: [unclosed\n")
    with pytest.raises(UserError, match=r"bad\.yaml:3"):
        code_in_task_dir(folder)


SECRET_NAMES = ["logger.project", "logger.entity", "logger.tags=[ok,${oc.env:MY_SERVICE_TOKEN}]", "logger.experiment",
                "hydra.job.name", "--multirun hydra.sweep.subdir"]


@pytest.mark.parametrize("where", SECRET_NAMES)
def test_a_secret_in_a_name_is_refused_without_echoing_it(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           cli_refusal) -> None:
    """Issue 40, security 2: names are shown in clear (a tracker's project, tags and experiment; the job's log file;
    every job directory, and with it the sweep's records), so a secret in one is refused before anything is
    written, and the refusal does not repeat it. The secret here is not token-shaped: only its variable's name
    (`*_TOKEN`) says it is one."""
    canary = "canary-name-value-48151623"
    monkeypatch.setenv("MY_SERVICE_TOKEN", canary)
    monkeypatch.chdir(tmp_path)
    flags, _, key = where.rpartition(" ")
    override = key if "=" in key else f"{key}=pre-${{oc.env:MY_SERVICE_TOKEN}}"
    code, err = cli_refusal([*flags.split(), override, "logger=wandb" if "logger" in key else "logger=jsonl"])
    assert code == 2 and "holds a secret" in err and key.split("=")[0] in err, err
    assert canary not in err and not list(tmp_path.iterdir())
