"""How a config key is declared, checked and set from text - the machinery under config.py.

    steps: int = ranged(200, "[1, inf)")          # a number in an interval
    decay: str = one_of("cosine", "linear")       # one of some words; the first is the default
    device: str = matching("auto", r"auto|cpu")   # a string matching a pattern

`check_field` refuses a value outside its declaration in one line naming the key and the fix, before
any work starts (never in a torch constructor later); `set_value` sets a dotted key from a TOML file or
the command line, converting the type and naming the closest valid keys when one does not exist."""

import contextlib
import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

from .errors import TitanliteError, closest


def ranged(default, interval: str, also: tuple = ()):
    """A number in `interval`, written as in maths: "[1, inf)", "(0, 1]"; `also`: extra
    allowed values outside it (dp_shard's -1). Floats must be finite whatever the interval."""
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    return dataclasses.field(
        default=default,
        metadata={"range": Range(lo, hi, interval[0] == "(", interval[-1] == ")", also)},
    )


def one_of(*choices: str):
    return dataclasses.field(default=choices[0], metadata={"choices": choices})


def matching(default: str, regex: str, shape: str, example: str | None = None):
    """A string matching `regex` in full; `shape` says which in words; `example` is the value an
    error message suggests where the default (say, "" for off) would not show the shape."""
    return dataclasses.field(
        default=default,
        # no example: the error message suggests the default
        metadata={"pattern": (regex, shape)}
        | ({"example": example} if example is not None else {}),
    )


@dataclasses.dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    also: tuple

    def admits(self, v) -> bool:
        return v in self.also or (
            math.isfinite(v)
            and (self.lo < v if self.lo_open else self.lo <= v)
            and (v < self.hi if self.hi_open else v <= self.hi)
        )

    def describe(self) -> str:
        open_ended = {
            (0, True): "positive",
            (1, False): "positive",
            (0, False): "zero or positive",
        }.get((self.lo, self.lo_open), f"{'>' if self.lo_open else '>='} {_num(self.lo)}")
        bounded = _BOUNDED[self.lo_open, self.hi_open].format(lo=_num(self.lo), hi=_num(self.hi))
        also = "".join(f" or {a}" for a in self.also)
        return (open_ended if self.hi == math.inf else bounded) + also


# A bounded range in words, said once ("between 1 and 1024" takes both ends), by which end is open.
_BOUNDED = {
    (False, False): "between {lo} and {hi}",
    (True, False): "between {lo} and {hi}, excluding {lo}",
    (False, True): "between {lo} and {hi}, excluding {hi}",
    (True, True): "strictly between {lo} and {hi}",
}


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() else str(x)


def check_field(cfg, key: str, value, f: dataclasses.Field) -> None:
    """Refuse `value` for `key` if it breaks the field's declared type, range, choices or pattern."""
    base, optional = _field_type(cfg, key)
    if value is None and optional:
        return
    # an int is a number too; a bool, though an int to Python, is not one here
    accepted = (int, float) if base is float else base
    if isinstance(value, bool) != (base is bool) or not isinstance(value, accepted):
        raise TitanliteError(
            f"{key} must be {_TYPE_NAMES[base]}, got {value!r} "
            f"({type(value).__name__}): e.g. {key} = {_example(f)!r}"
        )
    meta = f.metadata
    if "range" in meta and not meta["range"].admits(value):
        finite = "" if math.isfinite(value) or value in meta["range"].also else "a finite number "
        raise TitanliteError(
            f"{key} must be {finite}{meta['range'].describe()}, got {value!r}: "
            f"e.g. --{key} {_example(f)}"
        )
    if "choices" in meta and value not in meta["choices"]:
        raise TitanliteError(
            f"{key}='{value}' is not one of {', '.join(meta['choices'])}"
            f"{closest(value, meta['choices'])}: e.g. --{key} {meta['choices'][0]}"
        )
    if "pattern" in meta and not re.fullmatch(meta["pattern"][0], value):
        raise TitanliteError(
            f"{key} must be {meta['pattern'][1]}, got {value!r}: e.g. --{key} {_example(f)!r}"
        )


def _example(f: dataclasses.Field):
    """The declared example, else the default, else (a default of None keeps the preset's) the
    least value of the range."""
    r = f.metadata.get("range")
    least = _num(r.lo + (1 if r.lo_open else 0)) if r is not None else "none"
    return f.metadata.get("example", least if f.default is None else f.default)


def parse_overrides(cfg, overrides) -> dict:
    """['--a.b', 'v', '--c.d=w', '--flag'] or {'a.b': v} as {key: value}."""
    if overrides is None or isinstance(overrides, dict):
        return dict(overrides or {})
    pairs, args = {}, list(overrides)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise TitanliteError(
                f"unexpected argument '{arg}': overrides look like "
                f"--section.key value (e.g. --training.steps 50)"
            )
        key, equals, value = arg[2:].partition("=")  # --key=value
        if not equals and args and not args[0].startswith("--"):
            value = args.pop(0)  # --key value
        elif not equals and _field_type(cfg, key)[0] is bool:
            value = "true"  # a bare boolean flag switches it on
        elif not equals:
            raise TitanliteError(f"option --{key} needs a value, e.g. --{key} <value>")
        pairs[key] = value
    return pairs


def set_value(cfg, dotted: str, value, source: str = "override") -> None:
    """Set cfg.<section>.<key> = value after checking the key exists and converting the type."""
    section_name, _, key = dotted.partition(".")
    keys = {
        s.name: [f.name for f in dataclasses.fields(getattr(cfg, s.name))]
        for s in dataclasses.fields(cfg)
    }
    if key not in keys.get(section_name, ()):
        # How close each valid key is to the one given: whole dotted keys, so that a typo in
        # either part shows (training.stesp, trainig.steps); a bare --steps, to the names alone.
        ratio = {
            f"{s}.{n}": difflib.SequenceMatcher(None, f"{s}.{n}" if key else n, dotted).ratio()
            for s, names in keys.items()
            for n in names
        }
        # A typo (training.step) beats the same key in another section (--training.lr →
        # optimizer.lr; --steps → training.steps, then profile.steps: sorted() keeps the
        # sections' order), which beats a vaguer near miss (training.seed).
        word = key or section_name
        hits = sorted(
            (k for k in ratio if ratio[k] >= 0.6 or word in k),
            key=lambda k: (ratio[k] < 0.85, not k.endswith(f".{word}"), -ratio[k]),
        )[:3]
        valid = (
            f"valid keys in [{section_name}]: {', '.join(keys[section_name])}"
            if key and section_name in keys
            else f"sections are {', '.join(keys)}"
        )
        hint = f" (did you mean: {', '.join(hits)}?)" if hits else ""
        raise TitanliteError(f"unknown config key '{dotted}' ({source}){hint}; {valid}")
    setattr(getattr(cfg, section_name), key, _convert(value, *_field_type(cfg, dotted), dotted))


def _field_type(cfg, dotted: str) -> tuple[type | None, bool]:
    """(the key's type, whether None is allowed): `int | None` is (int, True)."""
    section_name, _, key = dotted.partition(".")
    # no such section: the hints of None's type, {}; no such key: None
    tp = typing.get_type_hints(type(getattr(cfg, section_name, None))).get(key)
    args = typing.get_args(tp)  # every optional key is declared `<type> | None`
    return (args[0], True) if type(None) in args else (tp, False)


# A TOML value or command-line text as the key's type `tp` (None where `optional`).
def _convert(value, tp: type, optional: bool, dotted: str):
    text = value.lower() if isinstance(value, str) else None
    if optional and (value is None or text in ("none", "null", "")):
        return None
    if tp is bool and (isinstance(value, bool) or text in _BOOLS):
        return _BOOLS.get(text, value)  # a TOML true/false is a bool already
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
_BOOLS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


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
    for section, values in doc.items():
        if not isinstance(values, dict):
            raise TitanliteError(f"'{section}' in {p} must be a [section] table, not a value")
    return {f"{section}.{key}": v for section, values in doc.items() for key, v in values.items()}
