"""`python -m jhicache.bench`'s command line: bad values are usage errors before anything runs,
and `--help` documents every option with its default once."""

from __future__ import annotations

import re

import jax
import pytest

from benchmarks import cli as bench_cli
from benchmarks import fleet, host_hit
from jhicache.bench import arg_types, cli, command
from jhicache.config import WritePolicy


def host_hit_args(argv: list[str]) -> object:
    """`python -m benchmarks.host_hit`'s command line: the shared options and its own."""
    return bench_cli.parse("host-hit", "", argv, host_hit.add_options)


def usage_error(capsys, argv: list[str], parse=cli.parse_args) -> str:
    """`parse`'s stderr for `argv`, which must exit like argparse does on a usage error."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Traceback" not in err
    return err


@pytest.mark.parametrize("option", ["--page-size", "--clients", "--rounds", "--request-length",
                                    "--output-length", "--device-kv-tokens", "--host-hit-prefix",
                                    "--host-hit-turn", "--max-parallel"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_sizes_must_be_positive_integers(capsys, option: str, value: str) -> None:
    if option.startswith("--host-hit"):
        err = usage_error(capsys, [option, value], host_hit_args)
    else:
        err = usage_error(capsys, ["multiturn", option, value])
    assert f"argument {option}:" in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_working_set_ratio_must_be_a_positive_number(capsys, value: str) -> None:
    assert "argument --working-set-ratio:" in usage_error(capsys, ["--working-set-ratio", value])


@pytest.mark.parametrize("value", ["0", "-1", "nan", "-inf", "x"])
def test_request_rate_must_be_positive_or_inf(capsys, value: str) -> None:
    assert "argument --request-rate:" in usage_error(capsys, ["--request-rate", value])


def test_sending_options_parse_and_default_to_todays_behaviour() -> None:
    args = cli.parse_args([])
    assert args.request_rate == float("inf") and args.max_parallel is None
    assert (args.ready_queue_policy, args.round_barrier) == ("fifo", "on")
    args = cli.parse_args(["--request-rate", "16", "--max-parallel", "8",
                           "--ready-queue-policy", "random", "--round-barrier", "off"])
    assert (args.request_rate, args.max_parallel) == (16.0, 8)
    assert cli.parse_args(["--request-rate", "inf"]).request_rate == float("inf")


@pytest.mark.parametrize("option", ["--ready-queue-policy", "--round-barrier"])
def test_sending_choices(capsys, option: str) -> None:
    assert f"argument {option}: invalid choice" in usage_error(capsys, [option, "lifo"])


@pytest.mark.parametrize(("option", "value"), [("--temperature", "-0.5"), ("--temperature", "nan"),
                                               ("--top-p", "0"), ("--top-p", "1.5"),
                                               ("--presence-penalty", "2.5"),
                                               ("--frequency-penalty", "nan"),
                                               ("--repetition-penalty", "0")])
def test_sampling_options_take_their_ranges(capsys, option: str, value: str) -> None:
    assert f"argument {option}:" in usage_error(capsys, ["multiturn", option, value])


def test_top_p_needs_a_temperature(capsys) -> None:
    assert "--top-p filters sampled answers" in usage_error(capsys, ["--top-p", "0.9"])
    args = cli.parse_args(["--temperature", "0.7", "--top-p", "0.9"])
    assert (args.temperature, args.top_p) == (0.7, 0.9)


def test_seed_may_be_zero_but_not_negative(capsys) -> None:
    assert cli.parse_args(["--seed", "0"]).seed == 0
    assert "argument --seed:" in usage_error(capsys, ["--seed", "-1"])


@pytest.mark.parametrize("modes", [",", "", " , ,"])
def test_modes_empty_after_splitting(capsys, modes: str) -> None:
    assert "argument --modes: no mode given" in usage_error(capsys, ["multiturn", "--modes", modes])


def test_modes_named_twice(capsys) -> None:
    assert "argument --modes:" in usage_error(capsys, ["multiturn", "--modes", "off,device,off"])


def test_modes_parse_to_a_tuple_in_order() -> None:
    assert cli.parse_args(["--modes", " unbounded, off "]).modes == ("unbounded", "off")
    assert cli.parse_args([]).modes == arg_types.MODES


def test_unknown_preset_lists_the_presets(capsys) -> None:
    err = usage_error(capsys, ["--preset", "foo"])
    assert "argument --preset: invalid choice: 'foo'" in err and "'qwen2-7b'" in err


def test_preset_takes_the_engines_spellings() -> None:
    assert cli.parse_args(["--preset", "Qwen/Qwen2-0.5B"]).preset == "qwen2-0.5b"


def test_weights_must_be_a_checkpoint_directory(capsys, tmp_path) -> None:
    assert "argument --weights:" in usage_error(capsys,
                                                ["--weights", str(tmp_path / "nonexistent")])
    assert "has no config.json" in usage_error(capsys, ["--weights", str(tmp_path)])
    (tmp_path / "config.json").write_text("{}")
    assert cli.parse_args(["--weights", str(tmp_path)]).weights == str(tmp_path)


def test_write_policy_choices_are_the_cache_policies(capsys) -> None:
    err = usage_error(capsys, ["--write-policy", "foo"])
    assert "argument --write-policy: invalid choice" in err
    assert all(f"'{policy.value}'" in err for policy in WritePolicy)


@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_output_folder_must_exist_before_the_run(capsys, tmp_path, option: str) -> None:
    err = usage_error(capsys, ["multiturn", option, str(tmp_path / "missing" / "x")])
    assert f"argument {option}:" in err and "does not exist" in err
    assert "is a directory" in usage_error(capsys, ["multiturn", option, str(tmp_path)])
    assert getattr(cli.parse_args(["multiturn", option, str(tmp_path / "x")]), option[2:])


@pytest.mark.parametrize("what", ["model", "host-hit"])
def test_plot_without_multiturn_is_an_error(capsys, tmp_path, what: str) -> None:
    plot = ["--plot", str(tmp_path / "p.png")]
    err = (usage_error(capsys, plot, host_hit_args) if what == "host-hit"
           else usage_error(capsys, [what, *plot]))
    assert "--plot draws the multiturn benchmark; use it with `multiturn` or `all`" in err


def test_pages_that_the_engine_would_reject(capsys) -> None:
    assert "--page-size 8192" in usage_error(capsys, ["--page-size", "8192"])
    err = usage_error(capsys, ["--page-size", "16", "--device-kv-tokens", "31"])
    assert "--device-kv-tokens 31" in err
    assert cli.parse_args(["--page-size", "16",
                           "--device-kv-tokens", "32"]).device_kv_tokens == 32


def help_entries(text: str) -> dict[str, str]:
    """Each argument's help text (joined across wrapped lines), by its first option string; an
    entry starts at a two-space indent, its help either beside it or on deeper-indented lines."""
    entries: dict[str, list[str]] = {}
    body = text.split("\npositional arguments:\n", 1)[1].split("\n\n", 2)
    for line in "\n".join(body[:2]).splitlines():
        start = re.match(r"^  (\S.*?)(?:\s{2,}(.*))?$", line)
        if start:
            name = start.group(1).split()[0].rstrip(",")
            entries[name] = [start.group(2) or ""]
        elif line.startswith("   ") and entries:
            entries[name].append(line.strip())
    return {name: " ".join(words).strip() for name, words in entries.items()}


# ids that are not "gpu": conftest skips tests with a `gpu` keyword on a CPU machine.
@pytest.mark.parametrize("backend", ["cpu", "gpu"], ids=["cpu-sizes", "gpu-sizes"])
def test_help_gives_every_option_a_help_text_and_one_default(monkeypatch, backend: str) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    parser = cli.build_parser()
    entries = help_entries(parser.format_help())
    options = [a.option_strings[0] if a.option_strings else "{" + ",".join(a.choices) + "}"
               for a in parser._actions]
    assert sorted(entries) == sorted(options)
    for name, help_text in entries.items():
        without_default = re.sub(r"\(default: [^)]*\)", "", help_text).strip()
        assert without_default, f"{name} has no help text"
        if name != "-h":
            assert help_text.count("default") == 1, f"{name}: {help_text!r}"
    assert "(default: write_back)" in entries["--write-policy"]
    assert "(default: inf)" in entries["--request-rate"]
    assert "(default: on)" in entries["--round-barrier"]
    expected_page_size = "64" if backend == "gpu" else "16"
    assert f"(default: {expected_page_size})" in entries["--page-size"]


def test_help_lists_the_write_policies() -> None:
    usage = cli.build_parser().format_usage()
    assert "{" + ",".join(p.value for p in WritePolicy) + "}" in usage


def test_cpu_runs_start_with_a_note_on_timings(monkeypatch, capsys) -> None:
    monkeypatch.setattr(command, "run", lambda args: {})
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert command.main(["model"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "CPU" in first and "only check that the bench runs" in first


def test_gpu_runs_have_no_timing_note(monkeypatch, capsys) -> None:
    monkeypatch.setattr(command, "run", lambda args: {})
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert command.main(["model"]) == 0
    assert "only check" not in capsys.readouterr().out



def fleet_args(argv: list[str]) -> object:
    return bench_cli.parse("fleet", "", argv, fleet.add_options)


def test_fleet_legs_parse_in_order_and_default_to_all(capsys) -> None:
    assert fleet_args([]).legs == fleet.LEGS
    assert fleet_args(["--legs", "single, shared"]).legs == ("single", "shared")
    for bad in ("shared,roter", ","):
        assert "argument --legs:" in usage_error(capsys, ["--legs", bad], fleet_args)
