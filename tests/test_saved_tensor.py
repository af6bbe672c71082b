"""fileio.saved_tensor: the tensor of a torch.save payload viewed in its buffer equals what
torch.load reads, for several dtypes and shapes (0-D, empty, 3-D); a payload whose storage is
larger than the tensor (a saved view) or a dtype/shape that does not match gives None (the
caller then uses torch.load)."""
from __future__ import annotations

import io

import pytest
import torch

from mcore_rl.fileio.saved_tensor import tensor_view


def _payload(t: torch.Tensor) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(t, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("t", [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor(3.5),
                               torch.randn(2, 3, 4).to(torch.bfloat16), torch.empty(0, 4),
                               torch.randint(0, 255, (1000,), dtype=torch.uint8)])
def test_view_equals_torch_load(t):
    payload = _payload(t)
    view = tensor_view(payload, t.dtype, tuple(t.shape))
    loaded = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    assert view is not None and view.dtype == loaded.dtype and view.shape == loaded.shape
    assert torch.equal(view, loaded)
    if t.numel():
        assert view.untyped_storage().data_ptr() == payload.untyped_storage().data_ptr()  # no copy


def test_mismatches_give_none():
    base = torch.randn(4, 4)
    assert tensor_view(_payload(base[:, :2]), base.dtype, (4, 2)) is None  # the saved storage is 16 floats
    assert tensor_view(_payload(base), torch.float64, (4, 4)) is None
    assert tensor_view(_payload(base), base.dtype, (4, 5)) is None
    assert tensor_view(torch.zeros(100, dtype=torch.uint8), base.dtype, (4, 4)) is None  # not a zip
