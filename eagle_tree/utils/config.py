"""Configs: a dataclass schema, a YAML file, then dotted ``key=value`` overrides.

Every command (train, decode, bench) describes its options as a (possibly nested) dataclass and
calls :func:`parse_cli`::

    @dataclass
    class TrainConfig:
        lr: float = 3e-4
        '''peak learning rate'''
        wandb: WandbConfig = field(default_factory=WandbConfig)
        '''Weights & Biases logging'''

    cfg = parse_cli(TrainConfig, ["--config", "train.yaml", "lr=1e-4", "wandb.mode=disabled"])

A field's help text (shown by ``--help``) is its attribute docstring: a string literal on the line
after the field (the one convention for every config of eagle_tree). Value ranges are checked in the
dataclass's ``__post_init__`` (``eagle_tree.utils.checks.check_range``), raising :class:`ConfigValueError`, which
the parser reports with the key's dotted path.
Values are checked against the annotations (int, float, bool, str, Path, ``X | None``, ``list[X]``,
``tuple[...]``, ``dict[str, X]``, ``Literal``, nested dataclasses); unknown keys are errors with a
suggestion. The resolved config is written with :func:`save_config` beside every checkpoint and result.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import sys
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

__all__ = ["ConfigError", "ConfigValueError", "load_config", "config_to_dict", "save_config",
           "parse_cli", "format_help", "read_yaml"]


class ConfigError(ValueError):
    """A config file, override or value that does not fit the schema."""


class ConfigValueError(ValueError):
    """A value out of its range, raised by a config dataclass; the parser prefixes the section's path."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key} {problem}")
        self.key, self.problem = key, problem


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise ConfigError(f"key {key!r} is given twice, on lines {seen[key]} and {line}: keep one (YAML would "
                                  "silently use the last)")
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep)


def read_yaml(text: str):
    """YAML text -> data, with safe types only and every mapping's keys unique (:class:`ConfigError`)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build ``schema`` from the YAML file at ``path`` (if any), then the dotted overrides in order."""
    data: dict = {}
    if path is not None:
        try:
            loaded = read_yaml(Path(path).read_text())
        except ConfigError as exc:
            raise ConfigError(f"config file {str(path)!r}: {exc}") from None
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from exc
        if not isinstance(loaded, dict | None):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping, not {type(loaded).__name__}")
        data = loaded or {}
    for text in overrides:
        _apply_override(schema, data, text)
    where = f" (in {str(path)!r})" if path is not None else ""
    return _build(schema, data, (), where)


def config_to_dict(cfg: Any) -> Any:
    """The config as plain YAML-safe data: dicts, lists, str, numbers, bools, None."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {str(k): config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML, atomically."""
    from eagle_tree.utils.atomic import write_text

    return write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def parse_cli(schema: type[T], argv: Sequence[str], prog: str | None = None) -> T:
    """``[--config FILE] [key=value ...]`` or ``--help``; on a bad config, print it and exit 2."""
    prog = prog or f"eagle-tree {schema.__name__}"
    path, overrides, args = None, [], list(argv)
    try:
        while args:
            arg = args.pop(0)
            if arg in ("-h", "--help"):
                print(format_help(schema, prog))
                raise SystemExit(0)
            if arg == "--config" or arg.startswith("--config="):
                if path is not None:
                    raise ConfigError("--config given twice")
                path = arg.partition("=")[2] or (args.pop(0) if args else None)
                if not path:
                    raise ConfigError("--config needs a file")
            elif arg.startswith("-"):
                raise ConfigError(f"unknown option {arg!r}; expected --config FILE and key=value overrides")
            else:
                overrides.append(arg)
        return load_config(schema, path, overrides)
    except ConfigError as exc:
        print(f"usage: {prog} [--config FILE] [key=value ...]\n{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def format_help(schema: type, prog: str = "eagle-tree") -> str:
    """Every field (dotted) with its type, default and help text."""
    lines = [f"usage: {prog} [--config FILE] [key=value ...]"]
    doc = inspect.getdoc(schema) or ""
    if doc and not doc.startswith(f"{schema.__name__}("):  # skip dataclass's generated signature
        lines += ["", doc]
    lines += ["", "options (key=value, dotted for nested sections; values are YAML):"]
    _help_lines(schema, "", lines)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# schema walking


def _fields(cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls) if f.init}


def _strip_optional(tp: Any) -> Any:
    """``X | None`` -> X; other unions are returned whole."""
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else Union[tuple(rest)]  # noqa: UP007
    return tp


def _dataclass_of(tp: Any) -> type | None:
    tp = _strip_optional(tp)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _unknown(parts: Sequence[str], i: int, cls: type, where: str = "") -> ConfigError:
    names = list(_fields(cls))
    key = ".".join(parts)
    msg = f"unknown config key {key!r}{where}"
    close = difflib.get_close_matches(str(parts[i]), names, n=1)
    if close:
        return ConfigError(f"{msg}; did you mean {'.'.join([*parts[:i], close[0], *parts[i + 1:]])!r}?")
    section = ".".join(parts[:i]) or "top level"
    return ConfigError(f"{msg}; valid keys at {section}: {', '.join(names)}")


def _apply_override(schema: type, data: dict, text: str) -> None:
    key, eq, raw = text.partition("=")
    parts = key.strip().split(".")
    if not eq or not all(parts):
        raise ConfigError(f"malformed override {text!r}: expected key=value, e.g. train.lr=3e-4")
    tp: Any = schema
    for i, name in enumerate(parts):
        cls = _dataclass_of(tp)
        if cls is None:
            if get_origin(_strip_optional(tp)) is dict:  # free-form mapping: any sub-key goes
                tp = Any
                break
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[:i])!r} is a value, not a section")
        if name not in _fields(cls):
            raise _unknown(parts, i, cls, " (in an override)")
        tp = _fields(cls)[name][0]
    node = data
    for name in parts[:-1]:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    _merge(node, parts[-1], _parse_value(raw, tp, key))


def _parse_value(raw: str, tp: Any, key: str) -> Any:
    try:
        value = read_yaml(raw)
    except ConfigError as exc:
        raise ConfigError(f"the value of {key!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse the value of {key!r}: {raw!r} is not valid YAML ({exc})") from exc
    inner = _strip_optional(tp)
    literal_str = get_origin(inner) is Literal and all(isinstance(a, str) for a in get_args(inner))
    stringy = inner is str or literal_str
    if stringy and value is not None and not isinstance(value, str):
        return raw  # name=123 or mode=off: keep the text, not YAML's int or bool
    return value


def _merge(node: dict, name: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(node.get(name), dict):
        for k, v in value.items():
            _merge(node[name], k, v)
    else:
        node[name] = value


def _build(cls: type[T], data: Any, prefix: tuple[str, ...], where: str) -> T:
    dotted = ".".join(prefix) or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{dotted!r} must be a mapping of keys, got {data!r}")
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            raise _unknown([*prefix, str(key)], len(prefix), cls, where)
    kwargs, missing = {}, []
    for name, (tp, f) in fields.items():
        if name in data:
            kwargs[name] = _coerce(_onto_factory(data[name], tp, f), tp, (*prefix, name), where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if _dataclass_of(tp) is not None:
                kwargs[name] = _build(_dataclass_of(tp), {}, (*prefix, name), where)
            else:
                missing.append(".".join((*prefix, name)))
    if missing:
        raise ConfigError(f"missing required config key(s): {', '.join(missing)}{where}")
    try:
        return cls(**kwargs)
    except ConfigValueError as exc:
        key = ".".join((*prefix, exc.key))
        raise ConfigError(f"config key {key} {exc.problem}{where}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {dotted}: {exc}") from exc


def _onto_factory(value: Any, tp: Any, f: dataclasses.Field) -> Any:
    """A section's given keys laid over its real default (the factory's instance, which may differ from the
    class defaults), so that ``data.max_length=64`` keeps the ``data.path`` the factory sets."""
    if _dataclass_of(tp) is None or not isinstance(value, dict) or f.default_factory is dataclasses.MISSING:
        return value
    base = config_to_dict(f.default_factory())
    if not isinstance(base, dict):
        return value
    for k, v in value.items():
        _merge(base, k, v)
    return base


def _coerce(value: Any, tp: Any, path: tuple[str, ...], where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert where lossless (int -> float...)."""
    key = ".".join(path)
    origin, args = get_origin(tp), get_args(tp)

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"config key {key!r}: expected {expected}, got {value!r}{where}")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _coerce(value, option, path, where)
            except ConfigError:
                if len(options) == 1:
                    raise
        raise bad(_type_name(tp))
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise bad(f"one of {', '.join(repr(a) for a in args)}")
    if _dataclass_of(tp) is not None:
        return _build(tp, value, path, where)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise bad(_type_name(tp))
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise bad(f"{len(args)} items ({_type_name(tp)})")
            pairs = enumerate(zip(value, args, strict=True))
            return tuple(_coerce(v, a, (*path, str(i)), where) for i, (v, a) in pairs)
        item = args[0] if args else Any
        items = [_coerce(v, item, (*path, str(i)), where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad(_type_name(tp))
        item = args[1] if args else Any
        return {k: _coerce(v, item, (*path, str(k)), where) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if tp in (int, float):
        number = value
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                raise bad(tp.__name__) from None
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise bad(tp.__name__)
        if not math.isfinite(number):
            raise bad(f"a finite {'number' if tp is float else 'int'} (NaN and infinities are refused)")
        if tp is int:
            if isinstance(number, float) and not number.is_integer():
                raise bad("int")
            return int(number)
        return float(number)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad("str (quote it in YAML)")
    if tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise bad("a path")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise bad(tp.__name__)
    return value


# ---------------------------------------------------------------------------------------------
# help


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if isinstance(tp, type) and not get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("pathlib.", "")


def _attribute_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal on the line after ``name: type = default``."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
            continue
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _help_lines(cls: type, prefix: str, lines: list[str], values: Any = None) -> None:
    """One entry per field; ``values`` is the section's real default (a factory may set other values than
    the class's own defaults, e.g. ``field(default_factory=lambda: SamplingConfig(temperature=0.0))``)."""
    docs = _attribute_docs(cls)
    for name, (tp, f) in _fields(cls).items():
        help_text = docs.get(name, "")
        if values is not None:
            default = getattr(values, name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        sub = _dataclass_of(tp)
        if sub is not None and default is not None:
            lines.append(f"  {prefix}{name}:" + (f"  {help_text}" if help_text else ""))
            _help_lines(sub, f"{prefix}{name}.", lines, None if default is dataclasses.MISSING else default)
            continue
        shown = "(required)" if default is dataclasses.MISSING else repr(config_to_dict(default))
        lines.append(f"  {prefix}{name}: {_type_name(tp)} = {shown}")
        lines += [f"      {line}" for line in help_text.splitlines()]
