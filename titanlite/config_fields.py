"""How a config key is declared, checked and set from text - the machinery under config.py.

    steps: int = ranged(200, "[1, inf)")          # a number in an interval
    decay: str = one_of("cosine", "linear")       # one of some words; the first is the default
    device: str = matching("auto", r"auto|cpu")   # a string matching a pattern

`check_field` refuses a value outside its declaration in one line naming the key and the fix, before
any work starts (never in a torch constructor later); `set_value` sets a dotted key from a TOML file or
the command line, converting the type and naming the closest valid keys when one does not exist."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

from .errors import TitanliteError, closest

INF = math.inf


def ranged(default, interval: str, also: tuple = ()):
    """A number in `interval`, written as in maths: "[1, inf)", "(0, 1]"; `also`: extra
    allowed values outside it (dp_shard's -1). Floats must be finite whatever the interval."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return field(
        default=default,
        metadata={"range": Range(lo, hi, interval[0] == "(", interval[-1] == ")", also, interval)},
    )


def one_of(*choices: str):
    return field(default=choices[0], metadata={"choices": choices})


def matching(default: str, regex: str, shape: str, example: str | None = None):
    """A string matching `regex` in full; `shape` says which in words; `example` is the value an
    error message suggests where the default (say, "" for off) would not show the shape."""
    meta = {"pattern": (regex, shape)} | ({"example": example} if example is not None else {})
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    also: tuple
    text: str

    def admits(self, v) -> bool:
        return v in self.also or (
            math.isfinite(v)
            and (self.lo < v if self.lo_open else self.lo <= v)
            and (v < self.hi if self.hi_open else v <= self.hi)
        )

    def describe(self) -> str:
        if self.hi == INF:
            words = {
                (0, True): "positive",
                (1, False): "positive",
                (0, False): "zero or positive",
            }.get((self.lo, self.lo_open), f"{'>' if self.lo_open else '>='} {_num(self.lo)}")
        else:
            words = f"between {_num(self.lo)} and {_num(self.hi)}, in {self.text}"
        return words + "".join(f" or {a}" for a in self.also)


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() else str(x)


def check_field(cfg, key: str, value, f: dataclasses.Field) -> None:
    """Refuse `value` for `key` if it breaks the field's declared type, range, choices or pattern."""
    base, optional = _field_type(cfg, key)
    if value is None and optional:
        return
    accepted = (int, float) if base is float else base
    if isinstance(value, bool) != (base is bool) or not isinstance(value, accepted):
        raise TitanliteError(
            f"{key} must be {_TYPE_NAMES[base]}, got {value!r} "
            f"({type(value).__name__}): e.g. {key} = {_example(key, f)!r}"
        )
    meta = f.metadata
    if "range" in meta and not meta["range"].admits(value):
        finite = "" if math.isfinite(value) or value in meta["range"].also else "a finite number "
        raise TitanliteError(
            f"{key} must be {finite}{meta['range'].describe()}, got {value!r}: "
            f"e.g. --{key} {_example(key, f)}"
        )
    if "choices" in meta and value not in meta["choices"]:
        raise TitanliteError(
            f"{key}='{value}' is not one of {', '.join(meta['choices'])}"
            f"{closest(value, meta['choices'])}: e.g. --{key} {meta['choices'][0]}"
        )
    if "pattern" in meta and not re.fullmatch(meta["pattern"][0], value):
        raise TitanliteError(
            f"{key} must be {meta['pattern'][1]}, got {value!r}: e.g. --{key} {_example(key, f)!r}"
        )


def _example(key: str, f: dataclasses.Field):
    """The default, or a sensible value where the default is None (keep the preset's)."""
    if "example" in f.metadata:
        return f.metadata["example"]
    if f.default is not None:
        return f.default
    r = f.metadata.get("range")
    return _num(r.lo + (1 if r.lo_open else 0)) if r is not None else "none"


def parse_overrides(cfg, overrides) -> list[tuple[str, object]]:
    """['--a.b', 'v', '--c.d=w', '--flag'] or {'a.b': v} as (key, value) pairs."""
    if overrides is None or isinstance(overrides, dict):
        return list((overrides or {}).items())
    pairs, args = [], list(overrides)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise TitanliteError(
                f"unexpected argument '{arg}': overrides look like "
                f"--section.key value (e.g. --training.steps 50)"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif args and not args[0].startswith("--"):
            value = args.pop(0)
        elif _field_type(cfg, key)[0] is bool:
            value = "true"  # a bare boolean flag switches it on
        else:
            raise TitanliteError(f"option --{key} needs a value, e.g. --{key} <value>")
        pairs.append((key, value))
    return pairs


def set_value(cfg, dotted: str, value, source: str = "override") -> None:
    """Set cfg.<section>.<key> = value after checking the key exists and converting the type."""
    section_name, _, key = dotted.partition(".")
    keys = {
        s.name: [f.name for f in dataclasses.fields(getattr(cfg, s.name))]
        for s in dataclasses.fields(cfg)
    }
    if section_name not in keys or not key:
        # '--steps': a key without its section. Same name first (training.steps, then profile.steps), then near.
        word = key or section_name
        rank = {
            f"{s}.{n}": (n != word, -difflib.SequenceMatcher(None, word, n).ratio())
            for s in keys
            for n in keys[s]
        }
        hits = ", ".join(
            [k for k in sorted(rank, key=rank.get) if rank[k][1] <= -0.6 or word in k][:3]
        )
        raise TitanliteError(
            f"unknown config key '{dotted}' ({source}){f' (did you mean: {hits}?)' if hits else ''}; "
            f"sections are {', '.join(keys)}"
        )
    names = keys[section_name]
    if key not in names:
        # A typo in this section (training.step) beats the same key in another section (fault.step;
        # --training.lr → optimizer.lr), which beats a vaguer near miss (training.seed).
        near = difflib.get_close_matches(dotted, [f"{section_name}.{n}" for n in names], 3, 0.6)
        close = [h for h in near if difflib.SequenceMatcher(None, dotted, h).ratio() >= 0.85]
        same_name = [f"{s}.{key}" for s in keys if key in keys[s]]
        hits = list(dict.fromkeys(close + same_name + near))
        hint = f" (did you mean: {', '.join(hits[:3])}?)" if hits else ""
        raise TitanliteError(
            f"unknown config key '{dotted}' ({source}){hint}; "
            f"valid keys in [{section_name}]: {', '.join(names)}"
        )
    setattr(getattr(cfg, section_name), key, _convert(value, _field_type(cfg, dotted), dotted))


def _field_type(cfg, dotted: str) -> tuple[type | None, bool]:
    """(the key's type, whether None is allowed): `int | None` is (int, True)."""
    section_name, _, key = dotted.partition(".")
    section = getattr(cfg, section_name, None)
    tp = typing.get_type_hints(type(section)).get(key) if section is not None else None
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def _convert(value, tp_optional: tuple[type | None, bool], dotted: str):
    tp, optional = tp_optional
    text = value.lower() if isinstance(value, str) else None
    if optional and (value is None or text in ("none", "null", "")):
        return None
    if tp not in _TYPE_NAMES:
        return value
    if tp is bool and (isinstance(value, bool) or text in _TRUE + _FALSE):
        return value if isinstance(value, bool) else text in _TRUE
    if tp is not bool and not isinstance(value, bool):  # true is neither 1 nor "True" here
        with contextlib.suppress(TypeError, ValueError):
            if tp is int and not (isinstance(value, float) and not value.is_integer()):
                return int(value.replace("_", "") if isinstance(value, str) else value)
            if tp is float:
                return float(value)
            if tp is str and isinstance(value, (str, int, float)):
                return str(value)
    raise TitanliteError(
        f"{dotted} must be {_TYPE_NAMES[tp]}{' or none' if optional else ''}, got {value!r}"
    )


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_steps(text: str, total_steps: int) -> tuple[int, int] | None:
    """'5-8' → (5, 8); '6' → (6, 6); '' → None (off). One line naming the fix otherwise."""
    text = (text or "").strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
    first, last = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    if not m or not 1 <= first <= last <= total_steps:
        raise TitanliteError(
            f"profile.steps must look like 5-8 within training.steps (1-{total_steps}), "
            f"got {text!r}: e.g. --profile.steps {min(2, total_steps)}-{min(3, total_steps)}"
        )
    return first, last


def check_all(cfg) -> None:
    """Every key of every section against its declaration (`check_field`), then the profiled
    steps against the run's (inside it, first <= last)."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            check_field(cfg, f"{section.name}.{f.name}", getattr(values, f.name), f)
    parse_steps(cfg.profile.steps, cfg.training.steps)


def read_toml(path) -> dict:
    """{"section.key": value} from a TOML file of [section] tables; one line for what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise TitanliteError(
            f"config file '{p}' does not exist: pass a TOML file, e.g. --config configs/debug.toml"
        )
    try:
        doc = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TitanliteError(f"config file '{p}' is not valid TOML ({e}): fix the syntax") from None
    out = {}
    for section, values in doc.items():
        if not isinstance(values, dict):
            raise TitanliteError(f"'{section}' in {p} must be a [section] table, not a value")
        out.update({f"{section}.{key}": value for key, value in values.items()})
    return out
