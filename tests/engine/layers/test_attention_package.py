"""The attention package's shape: imports point one way, no dead capability flags, and the
shared forward's defined output for a batch without requests."""

from __future__ import annotations

import grimp
import pytest
import torch

from fleetserve.engine.layers.attention.base import AttentionBackend
from fleetserve.engine.layers.attention.metadata import build_attention_metadata
from fleetserve.engine.layers.attention.selector import attention_backend_registry

PACKAGE = "fleetserve.engine.layers.attention"
BACKENDS = ["torch_backend", "triton_backend", "flash_backend"]


def test_the_selector_imports_the_backends_and_never_the_reverse() -> None:
    graph = grimp.build_graph("fleetserve", include_external_packages=False)
    selector = f"{PACKAGE}.selector"
    for backend in BACKENDS:
        assert graph.direct_import_exists(importer=selector, imported=f"{PACKAGE}.{backend}")
    for module in [*BACKENDS, "base", "metadata", "layer"]:
        chain = graph.find_shortest_chain(importer=f"{PACKAGE}.{module}", imported=selector)
        assert chain is None, f"{module} reaches the selector: {chain}"
    # No circle anywhere inside the package (the old attention.py <-> backends one included).
    modules = sorted(m for m in graph.find_descendants(PACKAGE))
    for a in modules:
        for b in modules:
            if a != b and graph.find_shortest_chain(importer=a, imported=b):
                assert not graph.find_shortest_chain(importer=b, imported=a), f"{a} <-> {b}"
    # The package itself re-exports nothing, so importing one module loads no other.
    assert not graph.find_modules_directly_imported_by(PACKAGE)


def test_backends_declare_only_capabilities_the_base_class_checks() -> None:
    """`supported_features` (which even claimed sliding_window) is gone, not silently ignored."""
    checked = {"supported_dtypes", "supported_head_sizes", "supported_block_sizes"}
    for backend in attention_backend_registry().values():
        declared = {name for name in vars(backend) if name.startswith("supported_")}
        assert declared <= checked, f"{backend.name} declares unchecked {declared - checked}"
        assert not hasattr(backend, "supported_features")


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_a_batch_without_requests_gives_zeros(name: str, device: torch.device) -> None:
    """Padding tokens only (slot -1): nothing is written and the output is zeros, not whatever
    memory the output happened to get."""
    backend_cls: type[AttentionBackend] = attention_backend_registry()[name]
    num_tokens, num_heads, num_kv_heads, head_size = 64, 4, 2, 32
    metadata = build_attention_metadata(
        [],
        [],
        torch.zeros((0, 1), dtype=torch.int32),
        torch.full((num_tokens,), -1, dtype=torch.int64),
        4,
        device,
    )
    assert metadata.num_reqs == 0
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(device)
    kv_cache = torch.zeros(2, 3, 4, num_kv_heads, head_size, device=device)
    # NOTE: free a NaN block of the output's size first: an uninitialised output would most
    # likely reuse it (and fail below) rather than happen to be zero.
    poison = torch.full_like(query, float("nan"))
    del poison
    out = backend_cls(num_heads, num_kv_heads, head_size).forward(
        query, key, key, kv_cache, metadata, head_size**-0.5
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.equal(out, torch.zeros_like(query))
    assert not kv_cache.any()
