"""Command-line helpers shared by train.py, generate, launch and eval: a bad argument is one line
on stderr naming the argument, the value and what is allowed, with exit status 2."""

from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and raw-text descriptions."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _checked(convert, text: str, ok, allowed: str):
    """`convert(text)` when it parses and `ok` holds, else argparse's error naming the value."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be {allowed}")
    return value


def positive_int(text: str) -> int:
    return _checked(int, text, lambda v: v > 0, "a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0 (nan, inf and 0 refused)."""
    return _checked(float, text, lambda v: 0 < v < float("inf"), "a positive number")


def nonnegative_float(text: str) -> float:
    return _checked(float, text, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def positive_int_list(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096]."""
    try:
        return [positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated positive integers") from None


def probability(text: str) -> float:
    return _checked(float, text, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")


def non_negative_float(text: str) -> float:
    return _checked(float, text, lambda v: v >= 0.0, "a number >= 0")


def subset_of(names: tuple[str, ...]):
    """A converter of 'a,b' to a tuple: a comma-separated subset of `names`."""
    allowed = f"a comma-separated subset of {','.join(names)}"
    return lambda text: _checked(lambda t: tuple(t.split(",")), text, lambda v: set(v) <= set(names), allowed)
