"""The documentation cannot rot: the generated reference is what the code gives now, and every llmexp command in a
code block of the site or the README passes the config check (in-process: Hydra's Compose API, the security
check and `validate`; no training, no subprocess), so a renamed key or a dead option fails here.

Commands are read from ```bash and ```console blocks (```text blocks are synopses and output, not checked).
In a console block, a command whose output starts with `llmexp: error:` must fail, with each line it shows.
Paths the commands name (data files, models, SLURM) are not looked for: the commands are composed only.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
DIR_COMMANDS = {"llmexp.doctor": set(), "llmexp.report": set(), "llmexp.status": {"--watch", "--scheduler-timeout"},
                "llmexp.fit": {"--target-params", "--out"}}
"""Commands that take a directory, not overrides, and their flags."""
RUN_FLAGS = {"--multirun", "-m", "--help", "-h", "--resolve", "--info", "--hydra-help"}
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
LEAVES = {"lr", "batch_size", "seed"}  # the top-level keys that are values, not groups
def test_reference_is_fresh() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import docs_reference

    for path, text in docs_reference.pages().items():
        assert path.is_file(), f"{path} is missing: run python tools/docs_reference.py"
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python tools/docs_reference.py"


def test_doctor_page_names_every_finding() -> None:
    from llmexp.monitor.detectors import DETECTOR_KINDS

    text = (DOCS / "explanation" / "doctor.md").read_text()
    assert not [kind for kind in sorted(DETECTOR_KINDS) if f"`{kind}`" not in text]


def test_readme_is_short_and_stays_inside_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text and "pip install -c constraints-cpu.txt -e ." in text
    for target in re.findall(r"\]\(([^)\s]+)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.exists() and path.is_relative_to(ROOT), f"README links to {target}, outside the repository"


def test_the_readme_and_the_sites_front_page_offer_the_same_pages() -> None:
    """README.md's "What it does" table is docs/index.md's with links from the repository's root: a page added to
    one is added to the other."""
    def rows(text: str) -> list[str]:
        section = text.split("## What it does")[1].split("\n## ")[0]
        return [line for line in section.splitlines() if line.startswith("|")]

    site = [row.replace("](", "](docs/") for row in rows((DOCS / "index.md").read_text())]
    assert rows((ROOT / "README.md").read_text()) == site


# ----------------------------------------------------------------------------- the commands in the docs


def commands() -> list[tuple[str, str, list[str], str | None]]:
    """(where, module, args, expected error or None) for every llmexp command in a bash or console block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            lang, body = match.group(1), match.group(2)
            if lang not in ("bash", "console"):
                continue
            line_no = text[:match.start()].count("\n") + 2
            where = f"{page.relative_to(ROOT)}:{line_no}"
            for line, output in _logical_lines(body, console=lang == "console"):
                if (parsed := _llmexp_command(line)) is not None:
                    error = "\n".join(output) if output and output[0].startswith("llmexp: error:") else None
                    found.append((where, *parsed, error))
    return found


def _logical_lines(body: str, console: bool) -> list[tuple[str, list[str]]]:
    """Commands with their continuation lines joined; in a console block, only `$ ` lines, with their output."""
    lines, out = body.splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i]
        if console and not line.startswith("$ "):
            i += 1
            continue
        line = line[2:] if console else line
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        output = []
        while console and i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        out.append((line, output))
    return out


def _llmexp_command(line: str) -> tuple[str, list[str]] | None:
    """(module, args) of `python -m llmexp[.X] ...`, `torchrun ... -m llmexp ...`, `llmexp ...`; else None."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError as err:
        raise AssertionError(f"cannot parse the command {line!r}: {err}") from None
    for i, token in enumerate(tokens):
        if token == "-m" and i + 1 < len(tokens) and re.fullmatch(r"llmexp(\.\w+)?", tokens[i + 1]):
            return tokens[i + 1], tokens[i + 2:]
        if token.endswith("launch/sbatch_multinode.sh"):  # its arguments are the run's overrides
            return "llmexp", tokens[i + 1:]
    if tokens and tokens[0] == "llmexp":
        return "llmexp", tokens[1:]
    return None


COMMANDS = commands()


def test_the_docs_hold_commands() -> None:
    assert len(COMMANDS) > 100  # the extraction itself still works


@pytest.fixture(scope="module")
def composer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """compose(overrides) -> the config `python -m llmexp OVERRIDES` would run, security-checked; one Compose API
    initialisation for the whole module (a composition then takes ~0.05 s)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from llmexp.config import security
    from llmexp.config.schema import register_configs
    from llmexp.config.tree import conf_dir, register_resolvers

    register_configs()
    register_resolvers()
    run_dir = tmp_path_factory.mktemp("docs-run")
    cache: dict[tuple[str, ...], Any] = {}

    def composed(overrides: list[str]) -> Any:
        overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")]  # (replaced by run_dir below)
        key = tuple(overrides)
        if key not in cache:
            cfg = compose("config", overrides=[*overrides, f"hydra.run.dir={run_dir}"], return_hydra_config=True)
            with open_dict(cfg):
                cfg.hydra.runtime.output_dir = str(run_dir)
            HydraConfig.instance().set_config(cfg)
            security.check_config(cfg)
            cache[key] = cfg
        return cache[key]

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield composed


def check_command(module: str, args: list[str], composer: Any) -> None:
    """Raise what `module args` would refuse before it trains: a typo, an unknown option, a value out of range."""
    from llmexp.cli.argv import check_args
    from llmexp.config.validation import validate

    if importlib.util.find_spec(module) is None:
        raise AssertionError(f"no module {module}")
    if module in DIR_COMMANDS:
        flags = [a for a in args if a.startswith("-")]
        assert set(flags) <= DIR_COMMANDS[module], f"{module} has no flag {flags}"
        return
    if module == "llmexp.estimate":
        args = [a for a in args if not a.startswith("world_size=")]
    sweep = "--multirun" in args or "-m" in args
    overrides, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif arg not in RUN_FLAGS:
            overrides.append(arg)
    check_args(overrides)
    if not sweep:
        validate(composer(overrides))
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from llmexp.sweep.check import check_configs
    from llmexp.sweep.space import edge_values, probe_job, search_space

    parsed = OverridesParser.create().parse_overrides(overrides)
    probe = probe_job(parsed)
    configs = [("probe", composer(probe))]
    if str(configs[0][1].hydra.sweeper._target_).endswith(".SearchSweeper"):
        search_space(parsed)  # the space itself: tags, bounds, sizes
    for i, override in enumerate(parsed):
        if not override.is_sweep_override():
            continue
        key, last = override.get_key_element(), edge_values(override)[-1]  # (the first value is the probe's)
        if "." in key or key in LEAVES:  # a value: set on the probe's config, as Hydra's override would set it
            cfg = copy.deepcopy(configs[0][1])
            OmegaConf.update(cfg, key, last, merge=False)
        else:  # a group's option: composed
            cfg = composer([*probe[:i], f"{key}={last}", *probe[i + 1:]])
        configs.append((f"{key}={last}", cfg))
    check_configs(configs, on_this_machine=False)


@pytest.mark.parametrize(("where", "module", "args", "error"), COMMANDS,
                         ids=[f"{w} {m} {' '.join(a)}"[:120] for w, m, a, _ in COMMANDS])
def test_command_composes(where: str, module: str, args: list[str], error: str | None, composer: Any) -> None:
    if error is None:
        try:
            check_command(module, args, composer)
        except Exception as err:  # a UserError, or Hydra's own parse and compose errors
            pytest.fail(f"{where}: python -m {module} {' '.join(args)}\n  fails the config check: {err}")
        return
    with pytest.raises(Exception) as raised:
        check_command(module, args, composer)
    shown = error.removeprefix("llmexp: error: ").splitlines()
    missing = [line.strip() for line in shown if line.strip() and line.strip() not in str(raised.value)]
    assert not missing, f"{where}: the docs show {missing}; the check says {raised.value}"


ROT = [["optimizer=adamw9bit"], ["train.max_stepz=10"], ["--multirun", "lr=1e-3,-1"],
       ["--multirun", "optimizer=adamw,lion9"], ["--multirun", "sweep=tpe", "lr=interval(1e-2,1e-5)"]]


@pytest.mark.parametrize("args", ROT)
def test_the_check_refuses_rot(args: list[str], composer: Any) -> None:
    """What a renamed key or a dead option in the docs would look like: refused."""
    with pytest.raises(Exception):  # noqa: B017  (a UserError or Hydra's own error, as the CLI would meet)
        check_command("llmexp", args, composer)
