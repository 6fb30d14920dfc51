"""The GGUF header reader of `engine.gguf_weights` (`tensor_blocks`): the same tensors, types
and block bytes as the gguf package's reader, on the default model's file."""
from __future__ import annotations

import numpy as np
import pytest

from pdserve.common.errors import ModelLoadError
from pdserve.engine import default_model, gguf_weights
from pdserve.kernels.quant import NATIVE_TYPES

gguf = pytest.importorskip("gguf")


def test_tensor_blocks_read_what_the_gguf_package_reads():
    path = default_model.locate()
    ours = list(gguf_weights.tensor_blocks(path))
    theirs = gguf.GGUFReader(str(path)).tensors
    assert [(name, qtype) for name, qtype, _ in ours] == [(t.name, int(t.tensor_type)) for t in theirs]
    native = 0
    for (name, qtype, data), tensor in zip(ours, theirs):
        if qtype in NATIVE_TYPES and len(tensor.shape) == 2:
            native += 1
            assert data.dtype == np.uint8 and np.array_equal(data, np.asarray(tensor.data)), name
        else:
            assert data is None, name
    assert native > 0


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        list(gguf_weights.tensor_blocks(bad))
