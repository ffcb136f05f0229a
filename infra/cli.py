"""The command line and TOML file of train.py: --key value, --key=value, --config FILE.toml;
the names are the fields of the dataclass it is handed (config.Config: train.py hands it).

    python train.py --config run.toml --learning_rate 3e-4 --beta=0.0 --vllm_server_urls a,b
    python train.py --help    # every field, its default and its help (config.py)

A TOML file holds the same keys; flags win over it wherever they stand on the line.
Unknown keys and values of the wrong type exit with status 2 and one line on stderr (the
closest field is suggested); contradictions between fields raise ValueError from Config.
"""

import dataclasses
import difflib
import re
import sys
import textwrap
import tomllib
import typing

from infra.options import default


def field_types(cls) -> dict:
    """Each field's type by name, annotations resolved (Optional[int], list[str], ...)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def convert(name: str, text, tp):
    """Turn a flag's text (or a TOML value) into the field's type; ValueError if it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if isinstance(text, str) and text.lower() in ("none", "null"):
            return None
        return convert(name, text, next(a for a in args if a is not type(None)))
    if origin is typing.Literal:  # the type of its values; Config refuses a value it does not list
        return convert(name, text, type(args[0]))
    if origin is list:
        items = text if isinstance(text, list) else [t for t in str(text).split(",") if t]
        return [convert(name, t, args[0]) for t in items]
    if tp is bool:
        if isinstance(text, bool):
            return text
        if str(text).lower() in ("true", "1", "yes"):
            return True
        if str(text).lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--{name} expects true or false, got {text!r}")
    if tp is str and isinstance(text, str):
        return text
    if tp is int and isinstance(text, int) and not isinstance(text, bool):
        return text
    if tp is int and isinstance(text, str) and re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    if tp is float and not isinstance(text, (bool, list, dict)):
        try:
            return float(text)
        except ValueError:
            pass
    raise ValueError(f"--{name} expects {tp.__name__}, got {text!r}")


def help_text(cls) -> str:
    lines = ["usage: train.py [--config FILE.toml] [--key value | --key=value ...]", "",
             f"Every field of {cls.__name__} (also valid as a key in the TOML file; flags override it):"]
    for f in dataclasses.fields(cls):
        lines.append(f"  --{f.name} (default {default(cls, f.name)!r})")
        lines += textwrap.wrap(f.metadata["help"], 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


# open-instruct names with no field of their own here, and what takes their place.
REPLACED = {
    "per_device_train_batch_size": "micro-batches are packed by tokens, not counted in sequences: set "
                                   "max_tokens_per_micro_batch (open-instruct's pack_length x per_device_train_batch_size)",
    "pack_length": "a micro-batch is one packed row: set max_tokens_per_micro_batch",
}


def unknown(name: str, names: list) -> str:
    if name in REPLACED:
        return f"{name!r} is not an option here; {REPLACED[name]}"
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    return f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else "; see --help")


def fail(msg: str):
    """Every command-line error: one line on stderr, exit status 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def split_argv(argv: list, types: dict) -> list:
    """[(key, text)] in command-line order from --key value, --key=value and a bare --flag
    (true, for a boolean field when no value follows)."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            fail(f"unexpected argument {arg!r}; options look like --key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if types.get(key) in (bool, typing.Optional[bool]) and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None:
                fail(f"--{key} needs a value")
            else:
                value, i = nxt, i + 1
        pairs.append((key, value))
        i += 1
    return pairs


def read_toml(path: str, types: dict) -> dict:
    """The values of a --config file; every key must be a field."""
    try:
        with open(path, "rb") as f:
            file_values = tomllib.load(f)
    except FileNotFoundError:
        fail(f"config file {path!r} does not exist; pass the path of a TOML file")
    except tomllib.TOMLDecodeError as e:
        fail(f"config file {path!r} is not valid TOML: {e}")
    except OSError as e:  # a directory, no permission
        fail(f"config file {path!r} cannot be read ({e.strerror}); pass the path of a TOML file")
    for k in file_values:
        if k not in types:
            fail(f"{path}: " + unknown(k, list(types)))
    return file_values


def merge(pairs: list, types: dict) -> dict:
    """{field: raw value}: the --config files first (the first file to set a key wins), then
    every other flag over them, wherever it stands on the line."""
    values = {}
    for key, value in pairs:
        if key == "config":
            for k, v in read_toml(value, types).items():
                values.setdefault(k, v)
    for key, value in pairs:
        if key == "config":
            continue
        if key not in types:
            fail(unknown(key, list(types)))
        values[key] = value
    return values


def parse_args(cls, argv=None):
    """A `cls` (config.Config) from `--key value`, `--key=value`, bare `--flag` for booleans, `--config
    FILE.toml` (flags win).

    Unknown keys and values of the wrong type exit with status 2 and one line on stderr;
    contradictions between fields raise ValueError from cls.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(cls))
        raise SystemExit(0)
    types = field_types(cls)
    kwargs = {}
    for key, value in merge(split_argv(argv, types), types).items():
        try:
            kwargs[key] = convert(key, value, types[key])
        except ValueError as e:
            fail(str(e))
    return cls(**kwargs)


def parse_args_or_exit(cls, argv=None):
    """train.py's entry: parse_args, with cls's refusals too as one `error:` line and exit status 2."""
    try:
        return parse_args(cls, argv)
    except ValueError as e:  # a contradiction between fields, or a value out of range: before anything starts
        fail(str(e))
