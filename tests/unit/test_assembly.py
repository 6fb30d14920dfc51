"""The assembler's quantization table covers every --quantization value the config takes."""
from __future__ import annotations

from pdserve.engine.assembly import QUANTIZED_LINEARS
from pdserve.engine.config import QUANTIZATIONS


def test_every_quantization_value_has_its_row():
    assert set(QUANTIZED_LINEARS) | {"auto"} == set(QUANTIZATIONS)  # "auto" resolves to one of them
