"""The cycle benchmark's set-ups hold what they measure: a full fleet (every filler admitted,
spot included) and exactly `depth` jobs queued behind it, none admitted by a timed cycle; and
the paced regime, whose every timed cycle admits the jobs that arrived before it."""

from __future__ import annotations

from typer.testing import CliRunner

from load.bench_cycle import Paced, app, build, time_cycles


def test_the_fleet_is_full_and_the_backlog_is_the_depth_asked_for() -> None:
    m, now = build(300, seed=1)
    assert m.views.pending_count() == 300
    cycles = time_cycles(m, now, 2)  # asserts every timed cycle admits nothing
    assert len(cycles) == 2


def test_the_paced_regime_admits_each_arrival_in_the_cycle_after_it() -> None:
    """The paced set-up (`--arrivals`): a fleet with room left after its burst, so every
    timed cycle admits exactly the jobs that arrived before it, as at a paced 1,000/s."""
    paced = Paced(seed=1, clusters=4, nodes=20, burst=200)
    assert paced.m.views.pending_count() == 0
    assert paced.m.views.live_count() == 200
    cpu, admitted = paced.timed_cycles(arrivals=3, cycles=5)
    assert len(cpu) == 5
    assert admitted == 15


def test_bad_counts_are_usage_errors_naming_the_option_and_nothing_runs() -> None:
    runner = CliRunner()
    for option, value in (("--arrivals", "0"), ("--arrivals", "1,x"), ("--depths", "")):
        result = runner.invoke(app, [option, value])
        assert result.exit_code == 2, (option, value, result.output)
        assert option in result.stderr
        assert "set-up" not in result.stdout  # refused before any fleet is built
