"""A property test over the whole schema: every leaf has a rule, and every rule refuses the values it must.

The leaves are found by walking the schema's dataclasses (`llmexp.config.schema.Config`, and the launchers' and
sweepers' `hydra.launcher.*` / `hydra.sweeper.*` configs in `hydra_plugins`), never listed here, so a new key
without a rule on its field (`llmexp.config.rules.key`, read by `rule_for`) fails `test_every_leaf_has_a_rule`.
For each leaf, hypothesis draws from what its rule refuses: values of the wrong type, out of range, empty, huge and
not finite; for each key that names a file or directory, a missing path, an empty file, a directory where a file belongs
and the reverse, and a symbolic link loop. Each must be refused by the CLI's own checks, in its order (the
schema's types as Hydra applies an override, the security check, `validate`, `check_environment`) with
nothing written, and the refusals reach the user as one exit-2 message: three real `python -m llmexp`
processes show that for a representative value of each kind of rule, many at once.

Cheap by design (~1 minute on 2 shared cores): configs are composed once per base and copied per example,
hypothesis is derandomized with a few examples per leaf.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra.types import RunMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from llmexp.config.keys import hydra_leaves, leaf_for, leaves
from llmexp.config.rules import (
    INT64_MAX,
    PATH_KINDS,
    Choice,
    Flag,
    PathRule,
    Range,
    Special,
    Text,
    TextList,
)
from llmexp.errors import UserError
from llmexp.machine.paths import KIND_CHECKS
from tests.conftest import compose, run_cli

EXAMPLES = 3
"""Examples per leaf, each drawing one value of every kind of badness; the generators aim at the edges."""

PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ----------------------------------------------------------------------------- the leaves, by walking the schema


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def _plugin_leaves() -> dict[str, tuple[Any, Any]]:
    """The `hydra.launcher.*` and `hydra.sweeper.*` leaves of llmexp's launchers and sweepers."""
    from hydra_plugins.llmexp_launcher.llmexp_launcher import LocalLauncherConf, SlurmLauncherConf
    from hydra_plugins.llmexp_sweeper.llmexp_sweeper import GridSweeperConf, SearchSweeperConf

    leaves: dict[str, tuple[Any, Any]] = {}
    for prefix, classes in (("hydra.launcher.", (LocalLauncherConf, SlurmLauncherConf)),
                            ("hydra.sweeper.", (GridSweeperConf, SearchSweeperConf))):
        for cls in classes:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                default = None if f.default is dataclasses.MISSING else f.default
                leaves[prefix + f.name] = (_unwrap(hints[f.name]), default)
    return leaves


def rule_for(key: str) -> Any:
    """The rule of a leaf (`rules.Range`, ...), or None: a bug `test_every_leaf_has_a_rule` reports."""
    return getattr(leaf_for(key), "rule", None)


LEAVES: dict[str, tuple[Any, Any]] = {**{k: (leaf.type, leaf.default) for k, leaf in leaves().items()},
                                      **_plugin_leaves()}
"""Every leaf: dotted key -> (type, default)."""


def test_every_leaf_has_a_rule() -> None:
    """A new key fails here until its field says what it takes (`key(default, rule, doc)` in config/schema.py;
    a launcher's or sweeper's own setting: `schema.LauncherSettings` / `SweeperSettings`)."""
    missing = sorted(key for key in LEAVES if rule_for(key) is None)
    assert not missing, f"leaves without a rule (declare them with key(default, rule, doc)): {missing}"
    stale = sorted(set(hydra_leaves()) - set(LEAVES))
    assert not stale, f"rules for keys the schema no longer has: {stale}"
    assert set(KIND_CHECKS) == set(PATH_KINDS), "every kind of path needs its check in machine/paths.py"


def test_every_rule_fits_its_type() -> None:
    """Numbers have a Range, booleans a Flag, strings a Choice, Text or PathRule, lists of strings a TextList."""
    for key, (tp, _) in LEAVES.items():
        rule = rule_for(key)
        if isinstance(rule, Special):
            assert rule.bad, f"{key}: a Special rule lists the values it refuses"
            continue
        expected = {int: Range, float: Range, bool: Flag, str: (Choice, Text, PathRule), Any: PathRule,
                    list[str]: TextList}.get(tp, ())
        assert isinstance(rule, expected), f"{key}: {type(rule).__name__} for a {tp}"


# ----------------------------------------------------------------------------- what each rule must refuse

WRONG_TYPE = {  # values the schema's types refuse as Hydra applies an override
    int: st.sampled_from(["abc", "", 1.5, "1.5", "inf", "nan", [1], {"a": 1}, True]),
    float: st.sampled_from(["abc", "", "1,5", [1.0], {"a": 1.0}, True]),
    bool: st.sampled_from(["maybe", "", 1.5, "truee", [True], {"a": True}]),
    str: st.sampled_from([[1], {"a": "b"}]),
    list: st.sampled_from(["abc", 5, {"a": "b"}]),
}


def _outside(rule: Range, tp: type) -> st.SearchStrategy[Any]:
    """Numbers outside `rule` (its `also` values left out), huge ones, and (for floats) inf and nan."""
    options: list[st.SearchStrategy[Any]] = []
    if tp is int:
        low, high = rule.low, rule.high
        if math.isfinite(low):
            edge = math.ceil(low) - (0 if rule.low_open and float(low).is_integer() else 1)
            options.append(st.integers(max_value=edge, min_value=edge - 10**6))
        if math.isfinite(high) and high < INT64_MAX:
            edge = math.floor(high) + (0 if rule.high_open and float(high).is_integer() else 1)
            options.append(st.integers(min_value=edge, max_value=edge + 10**6))
        options.append(st.integers(min_value=2**64, max_value=2**80))  # huge: beyond 64 bits
        options.append(st.integers(min_value=-(2**80), max_value=-(2**63) - 1))
        return st.one_of(options).filter(lambda v: v not in rule.also)
    if math.isfinite(rule.low):
        options.append(st.floats(max_value=rule.low, exclude_max=not rule.low_open, allow_nan=False,
                                 allow_infinity=False, min_value=-1e300))
    if math.isfinite(rule.high):
        options.append(st.floats(min_value=rule.high, exclude_min=not rule.high_open, allow_nan=False,
                                 allow_infinity=False, max_value=1e300))
    options.append(st.sampled_from([math.inf, -math.inf, math.nan, 1e400]))  # non-finite; 1e400 reads as inf
    return st.one_of(options)


def _bad_text(rule: Text) -> st.SearchStrategy[Any]:
    bad = [st.sampled_from(["", "   "]), st.just("x" * (rule.max_len + 1))]  # empty, huge
    if rule.one_line:
        bad.append(st.sampled_from(["a\nb", "line\r"]))
    if rule.public:  # a name shown in clear: a token-shaped value is a secret
        bad.append(st.just("hf_" + "x" * 30))
    return st.one_of(bad)


def _bad_choice(rule: Choice) -> st.SearchStrategy[Any]:
    return st.one_of(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12),
                     st.sampled_from(["", "x" * 5000, " ".join(rule.options)])).filter(lambda v: v not in rule.options)


def _parsed(text: str) -> Any:
    """A value as Hydra's override parser reads it from the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([f"k={text}"])[0].value()


def bad_values(key: str) -> dict[str, st.SearchStrategy[Any]]:
    """What the rule of `key` must refuse, by kind of badness (each example draws one of every kind)."""
    rule, tp = rule_for(key), LEAVES[key][0]
    kinds: dict[str, st.SearchStrategy[Any]] = {}
    if tp in WRONG_TYPE and not isinstance(rule, Special):
        kinds["wrong type"] = WRONG_TYPE[tp]
    if isinstance(rule, Range):
        kinds["out of range, huge or not finite"] = _outside(rule, tp)
    elif isinstance(rule, Choice):
        kinds["not an option, empty or huge"] = _bad_choice(rule)
    elif isinstance(rule, Text):
        kinds["empty, huge or two lines"] = _bad_text(rule)
    elif isinstance(rule, TextList):
        kinds["an item empty, huge or two lines"] = _bad_text(rule.item).map(lambda item: ["ok", item])
    elif isinstance(rule, PathRule):
        kinds["empty or huge"] = st.sampled_from(["", "  ", "x" * 5000])  # on the machine: PATH_SCENARIOS
    elif isinstance(rule, Special):
        kinds["what it lists"] = st.sampled_from(rule.bad).map(_parsed)
    return kinds


# ----------------------------------------------------------------------------- the CLI's checks, in process


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every base config's run, sweep and cache directories point: nothing may appear here."""
    return tmp_path_factory.mktemp("nothing-written")


def _base(scratch: Path, *overrides: str) -> Any:
    return compose([*overrides, f"hydra.sweep.dir={scratch / 'sweep'}", f"data.cache_dir={scratch / 'cache'}"],
                   scratch / "run-unused")


@pytest.fixture(scope="module")
def bases(scratch: Path) -> dict[str, Any]:
    """The configs the leaves live in: the default (grid, local), SLURM's launcher, a search's sweeper."""
    configs = {"default": _base(scratch), "slurm": _base(scratch, "cluster=slurm"),
               "search": _base(scratch, "sweep=tpe")}
    shutil.rmtree(scratch / "run-unused", ignore_errors=True)  # compose() makes it; no check may
    return configs


def _base_for(key: str, bases: dict[str, Any]) -> Any:
    for cfg in bases.values():
        parent = key.rsplit(".", 1)[0]
        node = OmegaConf.select(cfg, parent) if "." in key else cfg
        if node is not None and key.rsplit(".", 1)[-1] in node:
            return cfg
    raise AssertionError(f"{key} is in no base config")


def refused(cfg: Any, key: str, value: Any) -> str | None:
    """The refusal of `key=value` on a copy of `cfg` by the CLI's checks, or None.

    The schema's types, as Hydra applies an override (`OmegaConf.update`; the CLI reports Hydra's error with
    exit 2); then `validate`, `check_environment` and the security check (UserErrors: exit 2). The CLI runs the
    security check first; last here, it runs only for what the others accept, which changes no verdict and
    saves a third of the time. Anything else raised is a bug the test reports with its traceback."""
    from llmexp.config.security import check_config
    from llmexp.config.validation import validate
    from llmexp.machine.environment import check_environment

    probe = copy.deepcopy(cfg)
    try:
        with open_dict(probe):
            OmegaConf.update(probe, key, value, merge=True)
    except OmegaConfBaseException as err:
        return f"schema: {err}"
    for check in (validate, check_environment, check_config):
        try:
            check(probe)
        except UserError as err:
            return str(err)
    return None


def _assert_refused(bases: dict[str, Any], scratch: Path, key: str, value: Any, context: dict[str, Any]) -> None:
    cfg = _with(_base_for(key, bases), context)
    why = refused(cfg, key, value)
    assert why is not None, f"{key}={value!r} was accepted"
    assert not os.listdir(scratch), f"{key}={value!r} wrote {os.listdir(scratch)}"


CONTEXT: dict[str, dict[str, Any]] = {
    "data.train_file": {"data.name": "json"}, "data.eval_file": {"data.name": "json", "data.train_file": __file__},
    "data.path": {"data.name": "hf"}, "data.data_files": {"data.name": "hf", "data.path": "json"},
    "data.mix": {"data.name": "hf"}, "data.streaming": {},
}
"""Settings under which a key is read at all (a data file means something to data=json, not to stdlib)."""

def _with(cfg: Any, context: dict[str, Any]) -> Any:
    """A copy of `cfg` with the context's settings (`cfg` itself when there are none)."""
    if not context:
        return cfg
    probe = copy.deepcopy(cfg)
    with read_write(probe), read_write(probe.hydra), open_dict(probe), open_dict(probe.hydra):
        for k, v in context.items():
            OmegaConf.update(probe, k, v, merge=True)
    return probe


SWEEP_ONLY = sorted(k for k in LEAVES if isinstance(rule_for(k), Special) and rule_for(k).sweep_only)
"""Read by a sweep alone, so refused before a sweep launches: tests/test_sweep_check.py."""


@pytest.mark.parametrize("key", sorted(set(LEAVES) - set(SWEEP_ONLY)))
@PROPERTY
@given(data=st.data())
def test_every_leaf_refuses_what_its_rule_refuses(key: str, data: st.DataObject, bases: dict[str, Any],
                                                  scratch: Path) -> None:
    for kind, values in bad_values(key).items():
        _assert_refused(bases, scratch, key, data.draw(values, label=f"{key}, {kind}"), CONTEXT.get(key, {}))


# ----------------------------------------------------------------------------- keys that name files and directories

Scenario = Callable[[Path], str]
"""Builds a bad path in a fresh directory and returns it."""


def _missing(root: Path) -> str:
    return str(root / "missing" / "nothing-here")


def _empty_file(root: Path) -> str:
    (root / "empty.jsonl").write_text("")
    return str(root / "empty.jsonl")


def _a_file(root: Path) -> str:
    (root / "a_file.jsonl").write_text('{"text": "a file"}\n')
    return str(root / "a_file.jsonl")


def _empty_dir(root: Path) -> str:
    (root / "empty_dir").mkdir()
    return str(root / "empty_dir")


def _loop(root: Path) -> str:
    os.symlink(root / "loop", root / "loop")
    return str(root / "loop")


def _below_a_file(root: Path) -> str:
    return str(Path(_a_file(root)) / "below")


def _glob_of_nothing(root: Path) -> str:
    return str(root / "none-*.jsonl")


PATH_SCENARIOS: dict[str, dict[str, Scenario]] = {
    "dir_out": {"a file": _a_file, "a symlink loop": _loop, "below a file": _below_a_file},
    "data_file": {"missing": _missing, "an empty file": _empty_file, "a directory": _empty_dir, "a loop": _loop},
    "model": {"missing": _missing, "a file": _a_file, "an empty directory": _empty_dir, "a loop": _loop},
    "tokenizer": {"missing": _missing, "a file": _a_file, "an empty directory": _empty_dir, "a loop": _loop},
    "checkpoint": {"missing": _missing, "a file": _a_file, "an empty directory": _empty_dir, "a loop": _loop},
    "hf_source": {"missing": _missing, "a file": _a_file, "an empty directory": _empty_dir, "a loop": _loop},
    "hf_files": {"missing": _missing, "an empty file": _empty_file, "a directory": _empty_dir, "a loop": _loop,
                 "a glob of nothing": _glob_of_nothing},
    "task_dir": {"missing": _missing, "a file": _a_file, "an empty directory": _empty_dir, "a loop": _loop},
}
"""For each kind of path (`rules.PATH_KINDS`), the paths it must refuse: missing, empty, a file for a directory
and the reverse, a symbolic link loop."""

PATH_KEYS = sorted({*(k for k in LEAVES if isinstance(rule_for(k), PathRule)), "hydra.run.dir", "hydra.sweep.dir"})


def test_every_kind_of_path_has_its_bad_paths() -> None:
    assert set(PATH_SCENARIOS) == set(PATH_KINDS)


@pytest.mark.parametrize("key", PATH_KEYS)
def test_every_path_key_refuses_bad_paths(key: str, bases: dict[str, Any], scratch: Path,
                                          tmp_path: Path) -> None:
    kind = "dir_out" if key.startswith("hydra.") else rule_for(key).kind
    context = dict(CONTEXT.get(key, {}))
    if key == "hydra.sweep.dir":  # a sweep's directory is the one a sweep writes
        context["hydra.mode"] = RunMode.MULTIRUN
    probe = _with(bases["default"], context)
    for i, (name, scenario) in enumerate(PATH_SCENARIOS[kind].items()):
        root = tmp_path / str(i)
        root.mkdir()
        path = scenario(root)
        before = sorted(os.listdir(root))
        why = refused(probe, key, path)
        assert why is not None, f"{key} ({kind}) accepted {name}: {path}"
        assert key in why, f"{key} ({kind}), {name}: the message does not name the key:\n{why}"
        assert sorted(os.listdir(root)) == before and not os.listdir(scratch), f"{key}, {name}: something was written"


# ----------------------------------------------------------------------------- and through the real CLI

CLI_CASES: list[tuple[str, list[str], list[str]]] = [
    # the schema's types, refused on the command line before Hydra composes
    ("types", ["train.max_steps=1.5", "train.compile=maybe", "optimizer.eps=abc", "cluster.nodes=[1]"],
     ["train.max_steps=1.5", "train.compile=maybe", "optimizer.eps=abc"]),
    # ranges, choices, text, lists, a Special, a launcher's own spelling: validate, all at once
    ("values", ["train.eval_batches=0", "model.rope_theta=inf", "seed=18446744073709551616", "precision.name=fp9",
                "logger.project=''", "logger.tags=['ok','']", "lr=nan", "hydra.launcher.max_parallel=0",
                "sweep.pruner=asah", "data.split=''"],
     ["train.eval_batches: must be", "model.rope_theta: must be a finite number", "seed:", "precision.name: 'fp9'",
      "logger.project: must not be empty", "logger.tags[1]: must not be empty", "lr: must be > 0",
      "hydra.launcher.max_parallel: must be >= 1", "sweep.pruner: 'asah'", "data.split: must not be empty"]),
    # paths: check_environment, all at once
    ("paths", ["data=json", "data.train_file={t}/empty.jsonl", "data.tokenizer={t}/loop", "train.resume={t}/empty_dir",
               "data.cache_dir={t}/a_file.jsonl"],
     ["data.train_file={t}/empty.jsonl: is empty", "data.tokenizer={t}/loop: is a symbolic link loop",
      "train.resume={t}/empty_dir: holds no manifest.json", "data.cache_dir={t}/a_file.jsonl: is a file"]),
]


@pytest.mark.parametrize(("args", "fragments"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_the_cli_says_so_in_one_message_and_exit_2(args: list[str], fragments: list[str], tmp_path: Path) -> None:
    _empty_file(tmp_path), _loop(tmp_path), _empty_dir(tmp_path), _a_file(tmp_path)
    before = sorted(os.listdir(tmp_path))
    proc = run_cli([*(a.format(t=tmp_path) for a in args), f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                   timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.count("llmexp: error:") == 1, proc.stderr
    for fragment in fragments:
        assert fragment.format(t=tmp_path) in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
    assert sorted(os.listdir(tmp_path)) == before  # no run directory, no cache, no outputs/
