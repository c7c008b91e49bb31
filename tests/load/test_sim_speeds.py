"""GPU speeds in the simulator: the world's, the broker's prior, learning on or off, and the T4
share of GPU-hours the report prints (what shows whether placement prices work)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from load.report import summarize
from load.sim import Sim, broker_config, config_from_args, main
from load.sim.cli import parse_speeds
from load.simconfig import GPU_SPEED
from tests.load.small_sim import SMALL

FLAT = (("V100", 1.0), ("A100", 1.0), ("T4", 1.0))
# The world runs at the real speeds; a small fleet keeps these runs short.
REAL = replace(SMALL, jobs=80, gpu_speed=tuple(GPU_SPEED.items()))


def _t4_share(prior: tuple[tuple[str, float], ...]) -> float:
    sim = Sim(replace(REAL, prior_speed=prior), "muster")
    res = sim.run()
    assert res.violations == []
    gpu_type = {(p.cluster, p.flavor): p.gpu_type for p in sim.pools}
    end = res.base + res.end
    held = [
        (gpu_type[(log.cluster, log.flavor)], log.gpu_s(end))
        for ls in res.logs.values()
        for log in ls
    ]
    t4 = sum(s for t, s in held if t == "T4") / sum(s for _, s in held)
    assert summarize(res)["t4_share"] == pytest.approx(t4)
    return t4


def test_a_flat_prior_puts_more_gpu_hours_on_t4_than_the_true_speeds() -> None:
    # Priced by work on the true speeds a T4 (0.3x a V100) is the dearest choice; a broker that
    # believes every GPU equal ranks by $/GPU-hour and the cheap T4s take much more.
    true_prior = _t4_share(())
    flat = _t4_share(FLAT)
    assert flat > true_prior + 0.2, (flat, true_prior)


def test_the_prior_reaches_the_broker_and_learning_off_declares_it_for_every_job() -> None:
    cfg = replace(REAL, jobs=20, prior_speed=FLAT, learn_speeds=False)
    assert broker_config(cfg).scheduling.gpu_speeds == {"v100": 1.0, "a100": 1.0, "t4": 1.0}
    assert broker_config(REAL).scheduling.gpu_speeds == {"v100": 1.0, "a100": 2.2, "t4": 0.3}
    res = Sim(cfg, "muster").run()
    # Declared figures win over measured step rates (broker/core/speed.py): none are learned.
    assert {tuple(sorted(r.spec.gpu_speeds.items())) for r in res.records.values()} == {
        (("a100", 1.0), ("t4", 1.0), ("v100", 1.0))
    }
    learning = Sim(replace(cfg, learn_speeds=True), "muster").run()
    assert all(not r.spec.gpu_speeds for r in learning.records.values())


def _args(**speeds: object) -> SimpleNamespace:
    base = dict(
        jobs=10, offset=48_000, compress=3.0, max_duration_h=12.0, drain_h=24.0, seed=1,
        scale=1.0, spot="trace", poisson_rate=0.6, progress=0.0, traces_dir="", scenario=None,
    )  # fmt: skip
    return SimpleNamespace(**base, **speeds)


def test_speed_options_set_the_world_and_the_prior() -> None:
    cfg = config_from_args(
        _args(gpu_speeds="a100=1.3, T4=0.6", prior_speeds="V100=1,A100=1", learn_speeds=False), 1
    )
    assert dict(cfg.gpu_speed) == {"V100": 1.0, "A100": 1.3, "T4": 0.6}  # V100 kept, names kept
    assert cfg.prior_speed == (("V100", 1.0), ("A100", 1.0))
    assert cfg.learn_speeds is False
    assert config_from_args(_args(), 1).learn_speeds is True  # options left out: defaults


@pytest.mark.parametrize("bad", ["A100", "A100=x", "A100=0", "=2", "A100=-1", "T4=inf"])
def test_a_malformed_speed_says_what_to_write(bad: str) -> None:
    with pytest.raises(ValueError, match=r"--gpu-speeds: .* is not TYPE=SPEED .* write e\.g\."):
        parse_speeds(bad, "--gpu-speeds")


def test_the_command_refuses_a_malformed_speed_before_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--jobs", "5", "--out", "", "--prior-speeds", "T4=fast"]) == 2
    assert "--prior-speeds: 'T4=fast' is not TYPE=SPEED" in capsys.readouterr().err
