"""The kernel override dispatcher (seed part 3 §4, K5): an override rebinds aliases imported
before it and the `.kernel` of warmup owners, keeps the launch syntax, forwards by name or by
position, and an unknown keyword raises."""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fleetserve.kernels.dispatcher import KernelOverride, register_kernels, resolve_kernel

KERN = """\
import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


class Warmup:
    kernel = add_kernel
    _kernel_arg_names = ("stale",)


def launch(x, y):
    out = torch.empty_like(x)
    add_kernel[(1,)](x, y, out, x.numel(), BLOCK=16)
    return out
"""

USER = """\
import torch

from {pkg}.kern import add_kernel as aliased


def run(x, y):
    out = torch.empty_like(x)
    aliased[(1,)](x, y, out, n=x.numel(), BLOCK=16)
    return out
"""

IMPLS = """\
import triton
import triton.language as tl


@triton.jit
def sub_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) - tl.load(y_ptr + offs, mask=mask),
             mask=mask)


@triton.jit
def mul_kernel(a, b, c, size, BLK: tl.constexpr):
    offs = tl.arange(0, BLK)
    mask = offs < size
    tl.store(c + offs, tl.load(a + offs, mask=mask) * tl.load(b + offs, mask=mask), mask=mask)
"""

_COUNTER = itertools.count()


@pytest.fixture
def pkg(tmp_path: Path) -> Iterator[str]:
    """A fresh package (kern, user, impls) per test: overrides rebind modules for good."""
    name = f"fsk_test_{next(_COUNTER)}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "kern.py").write_text(KERN)
    (root / "user.py").write_text(USER.format(pkg=name))
    (root / "impls.py").write_text(IMPLS)
    sys.path.insert(0, str(tmp_path))
    importlib.import_module(f"{name}.user")  # the alias exists before the override
    importlib.import_module(f"{name}.impls")
    yield name
    sys.path.remove(str(tmp_path))
    for module in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[module]


def _module(name: str) -> ModuleType:
    return sys.modules[name]


def test_an_override_rebinds_aliases_imported_earlier_and_warmup_owners(pkg: str) -> None:
    kern, user, impls = (_module(f"{pkg}.{m}") for m in ("kern", "user", "impls"))
    original = kern.add_kernel
    assert resolve_kernel(f"{pkg}.kern.Warmup.kernel") == (kern.Warmup, "kernel")
    assert resolve_kernel(f"{pkg}.kern.add_kernel") == (kern, "add_kernel")
    x, y = torch.arange(8.0), torch.full((8,), 2.0)
    assert torch.equal(user.run(x, y), x + y)
    (wrapper,) = register_kernels({f"{pkg}.kern.add_kernel": impls.sub_kernel}).values()
    assert kern.add_kernel is wrapper and user.aliased is wrapper
    assert kern.Warmup.kernel is wrapper and kern.Warmup._kernel_arg_names is None
    assert wrapper.original is original and wrapper.func is original.fn
    assert torch.equal(kern.launch(x, y), x - y)  # positional + keyword, forwarded by name
    assert torch.equal(user.run(x, y), x - y)
    with pytest.raises(RuntimeError, match="already overridden"):
        register_kernels({f"{pkg}.kern.add_kernel": impls.sub_kernel})


def test_mismatched_names_forward_positionally_and_unknown_keywords_raise(pkg: str) -> None:
    kern, user, impls = (_module(f"{pkg}.{m}") for m in ("kern", "user", "impls"))
    (wrapper,) = register_kernels({f"{pkg}.kern.add_kernel": impls.mul_kernel}).values()
    assert isinstance(wrapper, KernelOverride) and not wrapper._forward_by_name
    x, y = torch.arange(8.0), torch.full((8,), 3.0)
    assert torch.equal(user.run(x, y), x * y)  # n=, BLOCK= reordered into mul_kernel's slots
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match=r"keyword\(s\) \['BLK'\] the original kernel"):
        kern.add_kernel[(1,)](x, y, out, x.numel(), BLK=16)


def test_a_plain_callable_override_and_bad_names(pkg: str) -> None:
    kern = _module(f"{pkg}.kern")
    calls: list[int] = []

    def torch_add(x_ptr: torch.Tensor, y_ptr: torch.Tensor, out_ptr: torch.Tensor, n: int,
                  BLOCK: int) -> None:  # fmt: skip
        calls.append(n)
        out_ptr.copy_(x_ptr + 2 * y_ptr)

    register_kernels({f"{pkg}.kern.add_kernel": torch_add})
    x = torch.arange(4.0)
    assert torch.equal(kern.launch(x, x), 3 * x) and calls == [4]
    with pytest.raises(ValueError, match="does not resolve"):
        register_kernels({f"{pkg}.nope.kernel": torch_add})
    with pytest.raises(ValueError, match=r"must be 'module\.kernel'"):
        resolve_kernel("kernel")
