"""Typed job configs: a dataclass -> argparse flags (+ optional ``--config file.yaml|json``) -> the dataclass.

Each field's ``metadata={"help": ...}`` becomes the flag's help text (``"aliases": ["--old-name"]`` adds other
spellings of the same flag, also accepted as keys of the config file); values come, in increasing priority, from the
dataclass default, the config file, then the command line.  ``list[...]`` fields take several values
(``--prompts a.jsonl b.jsonl``) or may be repeated.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path


def _base_type(tp):
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        return _base_type(args[0]) if len(args) == 1 else (str, False)
    if origin in (list, tuple):
        return (args[0] if args else str), True
    return tp, False


def _str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def build_parser(cls, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None,
                   help="YAML or JSON file with any of the options below (command-line flags override it)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, is_list = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", [])]
        help_ = f.metadata.get("help", "")
        help_ = f"{help_} (default: {default})" if default not in (None, [], "") else help_
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=help_)
        if tp is bool and not is_list:
            p.add_argument(*flags, type=_str2bool, nargs="?", const=True, metavar="BOOL", **kw)
            continue
        conv = tp if tp in (int, float, str) else (Path if tp is Path else str)
        if is_list:
            p.add_argument(*flags, type=conv, nargs="+", action="extend", **kw)
        else:
            p.add_argument(*flags, type=conv, **kw)
        if "choices" in f.metadata:
            p._actions[-1].choices = f.metadata["choices"]
    return p


def load_config_file(path: Path) -> dict:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"config file {path}: expected a mapping at the top level")
    return {k.replace("-", "_"): v for k, v in data.items()}


def parse_config(cls, argv=None, description: str = "", epilog: str | None = None):
    """Parse ``argv`` into an instance of dataclass ``cls`` (file values, then flags)."""
    parser = build_parser(cls, description or (cls.__doc__ or ""), epilog)
    ns = vars(parser.parse_args(argv))
    cfg_file = ns.pop("config", None)
    values = load_config_file(cfg_file) if cfg_file else {}
    aliases = {a.lstrip("-").replace("-", "_"): f.name for f in dataclasses.fields(cls)
               for a in f.metadata.get("aliases", [])}
    values = {aliases.get(k, k): v for k, v in values.items()}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        parser.error(f"unknown option(s) in {cfg_file}: {sorted(unknown)}")
    values.update(ns)
    hints = typing.get_type_hints(cls)
    for k, v in list(values.items()):
        tp, is_list = _base_type(hints[k])
        if tp is Path and v is not None:
            values[k] = [Path(x) for x in v] if is_list else Path(v)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
