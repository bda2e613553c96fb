"""The argparse types of `python -m jhicache.bench`: each checks one value (those that the
server's command shares are `jhicache.arg_types`')."""

from __future__ import annotations

import argparse
import json
import urllib.parse
from pathlib import Path

from jhicache.arg_types import parsed_number, text_or_file
from jhicache.models.presets import PRESETS, preset_config
from jhicache.models.weights import CONFIG_FILE

# unbounded: the device cache holding the whole working set
MODES = ("off", "device", "hierarchical", "unbounded")


def storage_directory(text: str) -> str:
    """argparse type: a directory for the storage tier's files, made (with its parents) if it
    does not exist yet."""
    try:
        Path(text).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot make this directory ({e})") from e
    return text


def store_config(text: str) -> str:
    """argparse type: a Mooncake Store client config, a JSON object or "@FILE" holding one; its
    keys are checked where the engine's config is made."""
    try:
        body = text_or_file(text)
        value = json.loads(body)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return body


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = parsed_number(float, text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def request_rate(text: str) -> float:
    """argparse type: requests/s, a number > 0 or `inf` (every ready request at once)."""
    value = parsed_number(float, text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0, or inf")
    return value


def preset_name(text: str) -> str:
    """argparse type: the PRESETS key that `text` names under preset_config's spelling rules
    (any case, an optional `Qwen/`), so that `choices` accepts what the engine accepts."""
    try:
        config = preset_config(text)
    except ValueError:
        return text  # not a preset: `choices` rejects it and lists the presets
    return next(name for name, preset in PRESETS.items() if preset is config)


def checkpoint_dir(text: str) -> str:
    """argparse type: a directory holding a Hugging Face config.json."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not (Path(text) / CONFIG_FILE).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no {CONFIG_FILE}")
    return text


def output_file(text: str) -> str:
    """argparse type: a file path whose folder exists (checked now, not after an hour's run)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist")
    return text


def server_url(text: str) -> str:
    """argparse type: a server's base URL, http(s)://HOST[:PORT], without a trailing slash."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # for its ValueError: a port that is not a number, or out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://HOST:PORT (or https://)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r}: expected the server's base URL, "
                                         "http://HOST:PORT, with no path")
    return f"{parts.scheme}://{parts.netloc}"


def mode_list(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated MODES, at least one, none twice."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        choices = ", ".join(MODES)
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {choices}")
    if not modes:
        raise argparse.ArgumentTypeError(f"no mode given; choose from {', '.join(MODES)}")
    if len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"{text!r} names a mode twice")
    return modes
