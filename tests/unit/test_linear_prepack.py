import torch
import torch.nn.functional as F

from pdserve.engine.models.linear import Linear, can_prepack


def test_prepacked_linear_equals_f_linear_at_decode_and_prefill_rows():
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    assert can_prepack(torch.device("cpu"), torch.float32)
    packed = Linear(w, b, prepack=True)
    assert packed.weight is None  # the packed copy replaces the checkpoint layout
    for rows in (1, 8, 200):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
