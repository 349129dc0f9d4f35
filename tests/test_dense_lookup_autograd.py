"""fbgemm's CPU build registers its dense TBE lookup for the CPU key only; its kernel records the
gradient itself, and PyTorch's autograd fallback warned at every backward ("an autograd kernel was not
registered", on every rank of ``make run``). ``ops.tbe`` registers the Autograd fallthrough PyTorch's
warning prescribes: the warning is gone and the kernel's own backward still gives the exact gradient."""

from __future__ import annotations

import warnings

import torch

from torchrec_herald.ops.tbe import DENSE_LOOKUP_OP, dense_lookup, register_dense_lookup_autograd


def _bags() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5, 2])  # an empty bag and repeated rows included
    indices = torch.randint(0, 12, (int(lengths.sum()),), generator=g)
    return indices, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


def test_dense_lookup_gradient_equals_embedding_bags_without_a_warning() -> None:
    indices, offsets = _bags()
    w = torch.randn(12, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dense_lookup(w, indices, offsets)
        out.backward(upstream)
    assert not [c for c in caught if "autograd kernel was not registered" in str(c.message)]

    ref_w = w.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.embedding_bag(indices, ref_w, offsets[:-1], mode="sum")
    ref.backward(upstream)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(w.grad, ref_w.grad, rtol=1e-6, atol=1e-7)
    assert float(w.grad.abs().sum()) > 0


def test_the_autograd_registration_is_made_once() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key(DENSE_LOOKUP_OP, "Autograd")
    assert register_dense_lookup_autograd() is False  # already there: importing ops.tbe made it
