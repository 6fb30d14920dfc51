"""`pdserve bench network`'s table and its refusal where no lab can be built (no root needed)."""
from __future__ import annotations

from pdserve.bench import network
from pdserve.bench.network import Sample, parse_rate, table


def _sample(mode: str, rate: str, ttft_s: float, kv: int = 0) -> Sample:
    return Sample(mode, rate, ttft_s, kv, 10.0 if kv else 0.0, kv + 1000, "prefill" if kv else "",
                  "least_loaded" if kv else "short_uncached_prompt")


def test_the_table_gives_medians_bytes_and_where_disaggregation_pays():
    samples = [_sample("disaggregated", "0.2", t, 95_000_000) for t in (8.0, 9.0, 8.5)]
    samples += [_sample("disaggregated", "unshaped", t, 95_000_000) for t in (4.0, 4.2, 4.1)]
    samples += [_sample("local", rate, 4.5) for rate in ("0.2", "unshaped")]
    samples += [_sample("router", "0.2", 4.6), _sample("router", "unshaped", 4.1, 95_000_000)]
    lines = table(samples, ["0.2", "unshaped"]).splitlines()
    assert lines[1].split()[:5] == ["0.2", "8.50", "4.50", "95.0", "95.0"]
    assert "local (short_uncached_prompt)" in lines[1] and "prefill host (least_loaded)" in lines[2]
    assert lines[-1].endswith("at: unshaped")


def test_rates_are_gbit_per_second_or_unshaped():
    assert parse_rate("0.2") == 2e8 and parse_rate("unshaped") is None


def test_the_benchmark_says_why_it_cannot_run(monkeypatch, capsys):
    monkeypatch.setattr(network, "unavailable", lambda: "the network lab needs root (ip netns add)")
    assert network.main(["--rates", "1"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_the_plot_shows_each_mode_per_rate_and_the_routers_choice(tmp_path):
    import xml.etree.ElementTree as ET

    from pdserve.bench.network_plot import write_plot

    samples = [_sample("disaggregated", "0.2", t, 95_000_000) for t in (8.0, 9.0, 8.5)]
    samples += [_sample("disaggregated", "unshaped", t, 95_000_000) for t in (4.0, 4.2, 4.1)]
    samples += [_sample("local", rate, 4.5) for rate in ("0.2", "unshaped")]
    samples += [_sample("router", "0.2", 4.6), _sample("router", "unshaped", 4.1, 95_000_000)]
    path = write_plot(samples, ["0.2", "unshaped"], tmp_path / "plots" / "ttft.svg", prompt_tokens=2048)
    root = ET.parse(path).getroot()  # a well-formed SVG
    text = " ".join(t for t in root.itertext() if t.strip())
    for label in ("disaggregated", "local", "router", "0.2 Gbit/s", "router: local", "router: prefill host",
                  "TTFT of 2048-token prompts", "TTFT (s)"):
        assert label in text, label
    assert write_plot(samples, ["0.2", "unshaped"], tmp_path / "ttft.png", 2048).read_bytes()[:4] == b"\x89PNG"


def test_a_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys):
    import importlib.util

    import pytest

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit):
        network.main(["--plot", "ttft.svg"])
    assert "--plot needs matplotlib" in capsys.readouterr().err
