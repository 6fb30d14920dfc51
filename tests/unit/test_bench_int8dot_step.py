"""`pdserve bench int8dot-step` runs through its three ways and prints their ratios."""
from __future__ import annotations

import pytest

from pdserve.bench import cli, int8dot_step

pytest.importorskip("torch")


def test_the_step_bench_prints_each_way_beside_the_read(capsys):
    assert cli.load("int8dot-step") is int8dot_step.main
    assert int8dot_step.main(["--threads", "1", "--rows", "1", "--rounds", "3", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "path " in out and "rows 1: packed " in out and "packed/read " in out and "unpacked/read " in out


def test_the_weights_are_the_models_shapes():
    ws = int8dot_step.weights(2)
    assert [(w.out_features, w.in_features) for w in ws] == list(int8dot_step.SHAPES) * 2 + [int8dot_step.HEAD]
    assert {w.type_name for w in ws} == {"Q4_1", "Q8_0"}
