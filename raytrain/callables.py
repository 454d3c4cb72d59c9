"""Naming user code on the command line: ``package.module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from raytrain.errors import UserError


def import_callable(spec: str, flag: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function, or a UserError that says how to make it importable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{flag} {spec!r} is not MODULE:FUNCTION: give e.g. mypkg.train:train_func")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"cannot import {module_name!r} for {flag} {spec} ({exc}): make it importable on every node "
            "(install it, or put its directory on PYTHONPATH)"
        ) from None
    func: Any = module
    for part in attr.split("."):
        func = getattr(func, part, None)
    if not callable(func):
        raise UserError(f"{flag} {spec}: {module_name} has no callable {attr!r}; give MODULE:FUNCTION")
    return func  # type: ignore[no-any-return]
