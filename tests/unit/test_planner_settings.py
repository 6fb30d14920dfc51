"""The planner's flags: `up --planner ...` and `pdserve planner ...` parse with the real CLI into
the typed settings (help defaults are the table's); limits and SLOs it cannot use are refused
with the flag's name before anything starts."""
from __future__ import annotations

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.deploy.cli import build_parser, resolve
from pdserve.planner.settings import PlannerSettings


def _settings(*argv: str) -> PlannerSettings:
    return PlannerSettings.from_settings(resolve(build_parser().parse_args(list(argv)), environ={}))


def test_up_planner_flags_reach_the_planner():
    s = _settings("up", "--planner", "--slo-ttft-ms", "800", "--slo-tpot-ms", "50", "--planner-interval-s", "5",
                  "--planner-min-decode", "2", "--planner-max-decode", "6", "--planner-agree-intervals", "3")
    assert s.planner and (s.slo().ttft_ms, s.slo().tpot_ms) == (800, 50)
    assert (s.limits().min_decode, s.limits().max_decode) == (2, 6)
    assert (s.live_config().interval_s, s.live_config().agree_intervals) == (5, 3)
    assert _settings("up") == PlannerSettings()  # nothing given: the table's defaults


def test_pdserve_planner_reads_its_api_key_from_the_environment():
    args = build_parser().parse_args(["planner", "--router-url", "http://r:8000", "--decode-deployment", "d"])
    s = PlannerSettings.from_settings(resolve(args, environ={"PDSERVE_API_KEY": "k"}))
    assert (s.api_key, s.router_url, s.decode_deployment) == ("k", "http://r:8000", "d")


@pytest.mark.parametrize("argv, flag", [
    (("--planner-min-decode", "3", "--planner-max-decode", "2"), "--planner-min-decode"),
    (("--planner-max-prefill", "0"), "--planner-min-prefill"),
    (("--slo-ttft-ms", "0"), "--slo-ttft-ms"),
    (("--planner-agree-intervals", "0"), "--planner-agree-intervals"),
])
def test_settings_it_cannot_use_are_refused_by_name(argv, flag):
    with pytest.raises(InvalidRequestError, match=flag):
        _settings("up", "--planner", *argv)


def test_up_refuses_a_bad_planner_setting_before_starting_anything(capsys):
    from pdserve.deploy.cli import main

    assert main(["up", "--planner", "--planner-min-decode", "5", "--planner-max-decode", "2"]) == 2
    assert "--planner-min-decode" in capsys.readouterr().err
