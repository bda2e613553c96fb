"""Renders BENCHMARKS.md from benchmarks/page.toml and the rows in benchmarks/results/.

    python scripts/benchmarks_page.py            # rewrites BENCHMARKS.md
    python scripts/benchmarks_page.py --check    # exit 1 if BENCHMARKS.md is not what it writes
    python scripts/benchmarks_page.py --uncited  # result files cited by neither the manifest,
                                                 # benchmarks/log/ nor README.md

The manifest lists one row per benchmark, in page order: its label, command, date and commit,
and which result file holds its cells. Each bench writes its own cells (result, ceiling, target,
met; `benchmarks/rows.py`) into its result file under "page_rows", so this script only renders.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "benchmarks" / "page.toml"
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
CITING = (*sorted((ROOT / "benchmarks" / "log").glob("*.md")), ROOT / "README.md")
HEADER = ["benchmark", "command", "date", "commit", "result", "ceiling (same run)", "target",
          "met"]
CELLS = ("result", "ceiling", "target", "met")

Json = dict[str, Any]


class ManifestError(Exception):
    """The manifest names a missing file or row, or a date its result file contradicts."""


@dataclass(frozen=True)
class Row:
    group: str
    label: str
    file: str
    row: str
    command: str
    date: str
    commit: str


def load_manifest(path: Path = MANIFEST) -> tuple[Json, list[Row]]:
    with path.open("rb") as f:
        raw = tomllib.load(f)
    return raw["page"], [Row(**r) for r in raw["row"]]


def load_result(row: Row, results: Path) -> Json:
    path = results / row.file
    if not path.is_file():
        raise ManifestError(f"row {row.label!r}: result file {path} does not exist")
    data: Json = json.loads(path.read_text())
    return data


def result_dates(data: Json) -> list[str]:
    """The run dates a result file records (its own, and its bench's), as YYYY-MM-DD."""
    found = [data.get("date"), data.get("bench", {}).get("date")]
    return [d[:10] for d in found if isinstance(d, str)]


def written_row(row: Row, results: Path) -> Json:
    """The cells the row's bench wrote into its result file, after checking the file's date."""
    data = load_result(row, results)
    for date in result_dates(data):
        if date != row.date:
            raise ManifestError(f"row {row.label!r}: {row.file} records the date {date}, the "
                                f"manifest {row.date}")
    cells: Json | None = data.get("page_rows", {}).get(row.row)
    if cells is None:
        raise ManifestError(f"row {row.label!r}: {row.file} has no page row {row.row!r}")
    return cells


def cells(row: Row, results: Path) -> list[str]:
    written = written_row(row, results)
    return [row.label, row.command, row.date, row.commit, *(written[c] for c in CELLS)]


def table_line(values: Sequence[str]) -> str:
    return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"


def render(page: Json, rows: Sequence[Row], results: Path = RESULTS) -> str:
    lines = [page["intro"].strip(), "", "## Results", "", page["table_intro"].strip(), "",
             table_line(HEADER), table_line(["---"] * len(HEADER))]
    group = None
    for row in rows:
        if row.group != group:
            group = row.group
            lines.append(table_line([f"**{page['groups'][group]}**"] + [""] * 7))
        lines.append(table_line(cells(row, results)))
    lines += ["", page["how"].strip(), "", page["limits"].strip(), ""]
    return "\n".join(lines)


# -- result files cited nowhere -----------------------------------------------------------------

# a cited file name or glob: "a_{b,c}.json", "host_hit_*" (a name ending "_*"), "..._x.json"
# ("..." read as "*")
_CITED = re.compile(r"[\w.\-*{},]+\.(?:json|png)|[\w.\-{},]+_\*")


def expand(pattern: str) -> list[str]:
    """Brace expansion, as the shell does it: "a_{b,c}.json" -> a_b.json, a_c.json."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    return [x for alt in match.group(1).split(",") for x in expand(head + alt + tail)]


def cited_patterns(texts: Sequence[str]) -> set[str]:
    tokens = (t for text in texts for t in _CITED.findall(text))
    return {p for t in tokens for p in expand(re.sub(r"^\.\.\.", "*", t))}


def uncited(rows: Sequence[Row], results: Path = RESULTS,
            citing: Sequence[Path] = CITING) -> list[str]:
    """Result files that neither a row (its file, or the files its cells were read from), the
    log nor the README cites."""
    patterns = cited_patterns([p.read_text() for p in citing])
    for row in rows:
        patterns |= {row.file, *written_row(row, results).get("files", [])}
    names = sorted(p.name for p in results.iterdir() if p.is_file())
    return [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]


# -- command line -------------------------------------------------------------------------------


def check(page_path: Path = PAGE, manifest: Path = MANIFEST, results: Path = RESULTS) -> bool:
    """Whether the page on disk is what this script writes."""
    page, rows = load_manifest(manifest)
    return page_path.is_file() and page_path.read_text() == render(page, rows, results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if BENCHMARKS.md differs from what would be written")
    parser.add_argument("--uncited", action="store_true",
                        help="list result files cited by neither the manifest, the log nor README")
    cli = parser.parse_args(argv)
    page, rows = load_manifest()
    if cli.uncited:
        for name in uncited(rows):
            print(name)
        return 0
    if cli.check:
        if check():
            return 0
        print(f"{PAGE.name} is out of date: run python scripts/benchmarks_page.py",
              file=sys.stderr)
        return 1
    PAGE.write_text(render(page, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
