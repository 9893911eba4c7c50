"""The command line's options: values that make no sense are refused naming the option and its range."""

from __future__ import annotations

import pytest

from coordinator.cli import options
from coordinator.cli.main import main, parse_args
from coordinator.runs.runner import MAX_ACTIVE
from workers.protocol.info import ModelInfo

SECONDS = "seconds in (0, 86400]"


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        *[("--forward-timeout", v, SECONDS) for v in ("0", "-1", "nan", "inf", "1e9", "soon")],
        *[("--build-timeout", v, SECONDS) for v in ("0", "-0.5", "nan", "-inf")],
        *[("--recover-timeout", v, "0 or " + SECONDS) for v in ("-1", "nan", "inf", "1e9", "soon", "")],
        *[("--stages", v, "whole number >= 1") for v in ("0", "-2", "1.5", "\u00b2")],
        *[("--max-active", v, "whole number of runs in 1..8") for v in ("0", "9", "2.5", "all", "9" * 5000)],
        *[("--db", v, "must name a file (or :memory:") for v in ("", "  ")],
        *[("--http", v, "the port in 0..65535") for v in ("h:-1", "h:65536", "h:\u0661", "h:", "8470")],
        ("--attach", "127.0.0.1:70000", "the port in 0..65535"),
        ("--attach", ":9000", "names no host"),
        ("--attach", "127.0.0.1:9000,", "names no host"),
        *[("--precision", v, "choose from 'packed', 'f32'") for v in ("f16", "q4_1", "")],
        *[
            ("--allow-host", v, "a host name or address, no port")
            for v in ("h:8470", "http://h", "", "-h", "a b")
        ],
    ],
)
def test_option_values_that_make_no_sense_are_refused_naming_the_option_and_its_range(
    capsys, option, value, says
):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "fake:layers=2", f"{option}={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and says in err and repr(value) in err


def test_option_values_in_range_are_taken():
    args = parse_args([
        "serve", "--model", "fake:layers=2", "--stages", "2", "--forward-timeout", "0.5",
        "--build-timeout", "86400", "--db", ":memory:", "--http", ":8080", "--attach", "a:1,[::1]:65535",
    ])  # fmt: skip
    got = (args.stages, args.forward_timeout, args.build_timeout, args.db, args.http, args.attach)
    assert got == (2, 0.5, 86400.0, ":memory:", ("127.0.0.1", 8080), ("a:1", "[::1]:65535"))


def test_the_recover_timeout_is_30_seconds_unless_told_and_0_turns_recovery_off():
    serve = ["serve", "--model", "fake:layers=2"]
    assert parse_args(serve).recover_timeout == 30.0
    assert parse_args([*serve, "--recover-timeout", "0"]).recover_timeout == 0.0
    assert parse_args([*serve, "--recover-timeout", "2.5"]).recover_timeout == 2.5


def test_runs_at_once_are_bounded_by_the_sessions_the_models_workers_keep(capsys, monkeypatch):
    few = ModelInfo(name="few", n_layers=2, input="hidden", hidden=4, max_sessions=2)
    monkeypatch.setattr(options, "describe", lambda spec: few)
    assert parse_args(["serve", "--model", "fake:layers=2"]).max_active == MAX_ACTIVE
    assert parse_args(["serve", "--model", "fake:layers=2", "--max-active", "2"]).max_active == 2
    with pytest.raises(SystemExit) as exited:
        parse_args(["run", "--model", "fake:layers=2", "--max-active", "3"])
    assert exited.value.code == 2
    says = "rlx-cluster run: error: argument --max-active: must be a whole number of runs in 1..2, got '3'"
    assert says in capsys.readouterr().err
