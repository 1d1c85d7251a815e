"""`--config run.toml`: a TOML file of flag settings, any flag on the command line
overriding it (docs/run_config.md).

A key is a flag's name without its dashes' prefix, spelled with `-` or `_`
(`checkpoint-dir`, `checkpoint_dir`); tables only group keys (`[training] lr = 3e-4` is
`lr = 3e-4`). Values are TOML's types: a string, a number or a boolean (`resume = true`
is `--resume`, `async-save = false` is `--no-async-save`). The file is spelled out as
the flags it stands for, placed before the command line's, so argparse checks each value
as it checks a flag and a later flag wins. `resolved` gives the settings a run uses,
which the CLI prints at start and stores in each checkpoint's manifest."""
from __future__ import annotations

import argparse
import tomllib

from engine.cli.args import UsageError

FLAG = "--config"


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config file, argv without it); the last --config wins."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG:
            if i + 1 == len(argv):
                raise UsageError("argument --config: expected one argument")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith(FLAG + "="):
            path = arg[len(FLAG) + 1:]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def load(path: str) -> dict:
    """The file's settings, tables flattened; UsageError (one line) if unreadable."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not TOML ({e})") from None
    flat = {}

    def walk(t: dict, where: str):
        for key, value in t.items():
            if isinstance(value, dict):
                walk(value, f"{where}{key}.")
            elif key.replace("_", "-") in {k.replace("_", "-") for k in flat}:
                raise UsageError(f"--config {path}: {where}{key} is set twice")
            else:
                flat[key] = value

    walk(table, "")
    return flat


def as_flags(settings: dict, parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line flags `settings` stand for, checked against `parser`."""
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        action = parser._option_string_actions.get(flag)  # argparse keeps no public map
        if action is None or flag in ("--help", FLAG):
            raise UsageError(f"--config {path}: unknown setting {key!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise UsageError(f"--config {path}: {key} = {value!r}: want true or false")
            out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                raise UsageError(f"--config {path}: {key} = {value!r}: want true or false")
            out += [flag] if value else []
        elif isinstance(value, (bool, list, dict)) or value is None:
            raise UsageError(f"--config {path}: {key} = {value!r}: want a string or number")
        else:
            out += [flag, str(value)]
    return out


def expand(argv: list[str], parser: argparse.ArgumentParser) -> tuple[str | None, list[str]]:
    """(the --config file, argv with `--config FILE` replaced by the file's flags,
    placed before the others)."""
    path, rest = config_path(list(argv))
    if path is None:
        return None, rest
    return path, as_flags(load(path), parser, path) + rest


# what `engine.cli.args.parse` adds to the parsed flags: not settings a file could give
DERIVED = ("config", "given", "hf", "model_name")


def resolved(args: argparse.Namespace) -> dict:
    """Every setting the run uses, by flag name (unset ones left out): as a `--config`
    file would spell them."""
    return {k.replace("_", "-"): v for k, v in sorted(vars(args).items())
            if v is not None and k not in DERIVED}


def to_toml(settings: dict) -> str:
    """`settings` as a TOML file, one `key = value` a line (strings quoted as JSON,
    which TOML's basic strings accept): a `--config` file of the same run."""
    import json

    def value(v):
        return str(v).lower() if isinstance(v, bool) else json.dumps(v)
    return "".join(f"{k} = {value(v)}\n" for k, v in settings.items())
