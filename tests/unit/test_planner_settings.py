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


def test_a_profile_makes_the_simulator_the_advisor_and_must_match_the_model(tmp_path):
    """`--planner-profile`: the live planner asks the simulator; a profile of another model
    stops `up` before any worker starts."""
    from pdserve.deploy.up import check_planner_profile
    from pdserve.planner.profile import ProfileError, save_profile
    from pdserve.planner.runner import default_advisor
    from pdserve.planner.profile import Profile, StepCost, TransferCost
    from pdserve.planner.types import Limits, Slo, WorkloadStats

    profile = Profile(model="m", compat_hash="00000000000000aa", device="cpu", source="test",
                      step=StepCost(0.002, 0.0002, 0.0, 0.0005, 1e-6), kv_bytes_per_token=1000,
                      kv_tokens=200_000, max_model_len=8192, transfers=(TransferCost("ucx", 1e9, 0.002),))
    path = save_profile(profile, tmp_path / "profile.json")
    settings = PlannerSettings.from_settings({"planner_profile": str(path)})
    advisor = default_advisor(settings)
    assert advisor.name == "simulator"
    advice = advisor.advise(WorkloadStats(0.5, 200, 32), Slo(2000, 200), Limits(0, 1, 1, 2))
    assert advice.shape.num_decode >= 1 and advice.reason
    assert default_advisor(PlannerSettings()).name == "threshold-fallback"
    with pytest.raises(ProfileError, match="compat|hash|model"):
        check_planner_profile({"planner": True, "planner_profile": str(path), "model": "default"})


def test_a_profile_not_written_yet_is_waited_for(tmp_path, caplog):
    """The chart's planner starts before its profile Job has written the profile: the fallback
    advises until the file is there, a file that does not load leaves the fallback advising, and
    the first valid one makes the simulator the advisor."""
    from pdserve.planner.profile import Profile, StepCost, TransferCost, save_profile
    from pdserve.planner.runner import default_advisor
    from pdserve.planner.types import Limits, Slo, WorkloadStats

    path = tmp_path / "profile" / "profile.json"
    advisor = default_advisor(PlannerSettings.from_settings({"planner_profile": str(path)}))
    ask = lambda: advisor.advise(WorkloadStats(0.5, 200, 32), Slo(2000, 200), Limits(0, 1, 1, 2))  # noqa: E731
    assert ask().shape.num_decode >= 1 and advisor.name == "threshold-fallback"
    path.parent.mkdir()
    path.write_text("{not json")
    with caplog.at_level("ERROR", logger="pdserve.planner"):
        ask()
        ask()
    assert advisor.name == "threshold-fallback"
    assert len([r for r in caplog.records if str(path) in r.getMessage()]) == 1  # logged once per error
    save_profile(Profile(model="m", compat_hash="", device="cpu", source="test",
                         step=StepCost(0.002, 0.0002, 0.0, 0.0005, 1e-6), kv_bytes_per_token=1000,
                         kv_tokens=200_000, max_model_len=8192, transfers=(TransferCost("ucx", 1e9, 0.002),)), path)
    assert ask().reason and advisor.name == "simulator"
