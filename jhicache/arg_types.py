"""The argparse types and actions that the package's commands share (`python -m jhicache.serve`,
`python -m jhicache.bench`): each type checks one number's range, so that a bad value is refused
as the command line is parsed, with the option's name."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(parsed_number(int, text))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(parsed_number(int, text))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = parsed_number(float, text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = parsed_number(float, text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


class Given(argparse.Action):
    """argparse's "store", which also adds the option to `given`: a default cannot tell
    whether the user asked for a value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = namespace.given | {self.option_strings[0]}


def penalty(text: str) -> float:
    """argparse type: a presence or frequency penalty, a number in [-2, 2] (OpenAI's range)."""
    value = parsed_number(float, text)
    if not -2.0 <= value <= 2.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number in [-2, 2]")
    return value


def text_or_file(text: str) -> str:
    """`text`, or with a leading "@" the text of the file it names (as SGLang's extra config
    flags read theirs); ValueError naming the file when it cannot be read."""
    if not text.startswith("@"):
        return text
    try:
        return Path(text[1:]).read_text()
    except OSError as e:
        raise ValueError(f"{text}: {e}") from e


def parsed_number(kind: type[int] | type[float], text: str) -> int | float:
    """`text` as an int or a float, or argparse's error saying it is not one."""
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
