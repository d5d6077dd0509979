"""The command line, checked before Hydra composes: typos, unknown options, wrong types, secrets moved out of sight."""

from __future__ import annotations

import contextlib
import difflib
import io
import itertools
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from llmexp.cli.hydra_internals import args_parser
from llmexp.config import security
from llmexp.config.keys import group_options, type_problem, unknown_key
from llmexp.errors import UserError
from llmexp.rundir import redact


def _parse_overrides(args: list[str]) -> tuple[Any, list[Any]]:
    """Hydra's own parse of the command line (its flags, then each override); anything it cannot parse is left
    to Hydra. Returns (argparse namespace or None, parsed overrides)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):  # (--version)
            namespace, _ = args_parser().parse_known_args(args)
    except SystemExit:
        return None, []
    parser, parsed = OverridesParser.create(), []
    for text in namespace.overrides or []:
        with contextlib.suppress(Exception):  # Hydra reports grammar errors itself, with the position
            parsed.extend(parser.parse_overrides([text]))
    return namespace, parsed


COMPLETION_WORDS = ("install", "uninstall", "query")
"""Hydra's `--shell-completion` subcommands."""
_MAX_VALUES = 10_001
"""Sweep values looked at here: a typo'd `range(0,100000000)` is the sweep check's to refuse, not to list."""


def _values(override: Any) -> list[Any]:
    if override.is_sweep_override():
        with contextlib.suppress(Exception):
            return list(itertools.islice(override.sweep_string_iterator(), _MAX_VALUES))
        return []
    return [override.value()]


def _override_errors(ov: Any, custom_tree: bool) -> list[str]:
    key = ov.key_or_group
    if ov.is_delete() or "/" in key or ov.package or key.split(".")[-1] == "_target_" or key.startswith("hydra."):
        return []  # a _target_ or hydra.*: judged on the composed config, interpolated (`security.config_problems`)
    options = group_options(key)
    if options is not None and not (ov.is_add() or ov.is_force_add()):
        return [e for e in (_option_error(key, v, options, custom_tree) for v in _values(ov) if v is not None) if e]
    problem = unknown_key(key)
    if problem and (ov.is_add() or ov.is_force_add()):
        problem += " (`+` adds keys to free-form dicts only, e.g. +optimizer.kwargs.foo=1)"
    if problem is None and not ov.is_sweep_override():
        problem = type_problem(key, ov.value())
    return [problem] if problem else []


def _option_error(group: str, value: Any, options: list[str], custom_tree: bool) -> str:
    """"" if `value` is fine, else the message."""
    text = str(value)
    if problem := security.path_problem(text):
        return f"{group}={text}: {problem}; pick one of {', '.join(options)}"
    if text in options or custom_tree:
        return ""  # --config-dir or a search path may add options that llmexp/conf/ does not list
    close = difflib.get_close_matches(text, options, n=1, cutoff=0.5)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={text}: no such option; {hint}the options are {', '.join(options)}"


def check_args(args: list[str]) -> list[str]:
    """The command line with secrets redacted, after a fast pass for typos (no composition): a UserError lists every
    problem found. What it cannot judge (grammar errors, options added through --config-dir, `_target_`s, `hydra.*`,
    anything a YAML file sets) is judged on the composed config (`cli.compose`) or by Hydra itself."""
    namespace, overrides = _parse_overrides(args)
    if namespace is not None and namespace.shell_completion:  # its words are Hydra's subcommand, not overrides
        if not any(word.split("=")[0] in COMPLETION_WORDS for word in namespace.overrides):
            raise UserError("--shell-completion needs what to do: install=bash (or zsh, fish), uninstall=bash, or "
                            "query=bash (Hydra's, for the shell's completion script)")
        return list(args)
    custom_tree = namespace is None or any(getattr(namespace, flag) is not None
                                           for flag in ("config_dir", "config_path", "config_name"))
    custom_tree = custom_tree or any(ov.key_or_group.startswith("hydra.searchpath") for ov in overrides)
    errors = [e for ov in overrides for e in _override_errors(ov, custom_tree) if e]
    if errors:
        raise UserError("invalid command line:\n  " + "\n  ".join(errors))
    return redact.redact_overrides(list(args))
