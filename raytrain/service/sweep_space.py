"""A sweep's search space: what ``--param`` (or a YAML/JSON file) says, checked, and as Ray Tune takes it.

``NAME=KIND:ARGS``, one parameter each:

- ``loguniform:LO:HI``, ``uniform:LO:HI``: a float drawn from [LO, HI] (log-uniformly, or uniformly);
- ``int:LO:HI``: an integer drawn uniformly from LO..HI, both included;
- ``choice:A,B,...``: one of the values, drawn at random;
- ``grid:A,B,...``: every value, each combined with every other grid parameter's (Ray Tune's grid search;
  ``--trials N`` then repeats the whole grid N times).

A value of ``choice`` and ``grid`` is read as JSON where it parses (``32``, ``0.1``, ``true``), else as a
string (``resnet18``). A file holds the same, ``{name: "KIND:ARGS"}``, or ``{name: {KIND: ARGS}}`` with
ARGS a list (``lr: {loguniform: [1e-4, 1e-1]}``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain.errors import UserError

KINDS = ("loguniform", "uniform", "int", "choice", "grid")
# How a sweep stops the trials that trail: ASHA (asynchronous successive halving), the median stopping rule,
# or not at all (Ray Tune's schedulers; ``raytrain.service.sweeps`` builds them).
SCHEDULERS = ("asha", "median", "none")
USAGE = "give NAME=KIND:ARGS with KIND one of loguniform:LO:HI, uniform:LO:HI, int:LO:HI, choice:A,B,..., grid:A,B,..."


@dataclass(frozen=True)
class Param:
    """One parameter of the space: its name, how it is drawn, and its bounds or values."""

    name: str
    kind: str
    values: tuple[Any, ...]  # (LO, HI) for a range; the values for choice and grid

    def __str__(self) -> str:
        sep = "," if self.kind in ("choice", "grid") else ":"
        shown = (json.dumps(v) for v in self.values)
        return f"{self.name}={self.kind}:{sep.join(shown)}"

    def extremes(self) -> tuple[Any, ...]:
        """The values a check must accept: both ends of a range, every value of a list."""
        return self.values

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "loguniform":
            return tune.loguniform(*self.values)
        if self.kind == "uniform":
            return tune.uniform(*self.values)
        if self.kind == "int":
            return tune.randint(self.values[0], self.values[1] + 1)  # Tune's upper bound is excluded
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return tune.grid_search(list(self.values))


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _number(text: Any, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UserError(f"{where}: {text!r} is not a number ({USAGE})") from None
    if not math.isfinite(value):
        raise UserError(f"{where}: {text!r} is not a finite number")
    return value


def make(name: str, kind: str, args: list[Any], where: str) -> Param:
    """A parameter from its parts, checked: a one-line error naming WHERE (the flag or file) otherwise."""
    if not name.isidentifier():
        raise UserError(f"{where}: {name!r} is not a parameter name ({USAGE})")
    if kind not in KINDS:
        raise UserError(f"{where}: unknown distribution {kind!r}: use one of {', '.join(KINDS)}")
    if kind in ("choice", "grid"):
        if not args:
            raise UserError(f"{where}: {kind} needs at least one value, e.g. {name}={kind}:32,64")
        return Param(name, kind, tuple(args))
    if len(args) != 2:
        raise UserError(f"{where}: {kind} takes LO:HI, e.g. {name}={kind}:1e-4:1e-1 ({len(args)} value(s) given)")
    if kind == "int":
        ends = [_number(a, where) for a in args]
        if not all(e.is_integer() for e in ends):
            raise UserError(f"{where}: int takes whole numbers LO:HI, e.g. {name}=int:1:8")
        lo, hi = float(int(ends[0])), float(int(ends[1]))
    else:
        lo, hi = (_number(a, where) for a in args)
    if not lo < hi:
        raise UserError(f"{where}: the range {lo:g}..{hi:g} is empty or reversed: give LO below HI")
    if kind == "loguniform" and lo <= 0:
        raise UserError(f"{where}: loguniform needs LO above 0 ({lo:g} given): use uniform for ranges from 0")
    return Param(name, kind, (int(lo), int(hi)) if kind == "int" else (lo, hi))


def parse_flag(text: str) -> Param:
    """``--param NAME=KIND:ARGS``."""
    where = f"--param {text!r}"
    name, sep, spec = text.partition("=")
    kind, colon, args = spec.partition(":")
    if not sep or not colon:
        raise UserError(f"{where} is not NAME=KIND:ARGS: {USAGE}")
    if kind in ("choice", "grid"):
        return make(name.strip(), kind, [_value(v.strip()) for v in args.split(",") if v.strip()], where)
    return make(name.strip(), kind, args.split(":"), where)


def parse_file(path: Path) -> list[Param]:
    """A YAML or JSON file of ``name: "KIND:ARGS"`` or ``name: {KIND: [ARGS]}`` entries."""
    import yaml

    where = f"--params-file {path}"
    try:
        raw = yaml.safe_load(path.read_text())  # JSON is YAML too
    except OSError as exc:
        raise UserError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{where} is not YAML or JSON{at}: fix it, or give --param NAME=KIND:ARGS") from None
    if not isinstance(raw, Mapping) or not raw:
        raise UserError(f"{where} holds no parameters: give a mapping of name: KIND:ARGS")
    params = []
    for name, spec in raw.items():
        if isinstance(spec, str):
            params.append(parse_flag(f"{name}={spec}"))
        elif isinstance(spec, Mapping) and len(spec) == 1:
            ((kind, args),) = spec.items()
            params.append(make(str(name), str(kind), list(args) if isinstance(args, list) else [args], where))
        else:
            raise UserError(f"{where}: {name!r} is neither KIND:ARGS nor {{KIND: [ARGS]}}")
    return params


@dataclass(frozen=True)
class SearchSpace:
    """The parameters of a sweep, each named once."""

    params: tuple[Param, ...]

    @classmethod
    def of(cls, flags: Iterable[str], file: Path | None) -> SearchSpace:
        params = [*(parse_file(file) if file else []), *(parse_flag(f) for f in flags)]
        if not params:
            raise UserError("a sweep needs a search space: give --param NAME=KIND:ARGS (repeatable) or --params-file")
        seen: set[str] = set()
        for p in params:
            if p.name in seen:
                raise UserError(f"parameter {p.name!r} is given twice: give each parameter once")
            seen.add(p.name)
        return cls(tuple(params))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def grid_size(self) -> int:
        """Trials one pass of the grid makes (1 with no grid parameter)."""
        return math.prod(len(p.values) for p in self.params if p.kind == "grid")

    def corners(self) -> Iterator[tuple[Param, dict[str, Any]]]:
        """Each parameter with a setting per extreme of it, the others at their first: what a check tries."""
        first = {p.name: p.values[0] for p in self.params}
        for p in self.params:
            for value in p.extremes():
                yield p, {**first, p.name: value}

    def to_tune(self) -> dict[str, Any]:
        return {p.name: p.to_tune() for p in self.params}

    def describe(self) -> str:
        return ", ".join(str(p) for p in self.params)

    def to_json(self) -> list[str]:
        return [str(p) for p in self.params]
