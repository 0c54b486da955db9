"""The CPU kernels' build cache: keyed by what the code depends on, built once, clear failures.

The compiler itself is stubbed here (a real build takes ~40 s; the fused-attention tests in
tests/engine/layers load the real one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.kernels.cpu import build


@pytest.fixture
def fake_compile(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []

    def compile_(compiler: str, target: Path) -> None:
        calls.append(target)
        target.write_bytes(b"not really a library")

    monkeypatch.setattr(build, "_compile", compile_)
    monkeypatch.setattr(build, "_compiler", lambda: "/usr/bin/true")
    return calls


def test_a_cached_library_is_not_rebuilt(tmp_path: Path, fake_compile: list[Path]) -> None:
    library, built = build.ensure_built(tmp_path)
    assert built and len(fake_compile) == 1
    assert library.exists() and library.parent.parent == tmp_path / "kernels"
    assert build.ensure_built(tmp_path) == (library, False)
    assert len(fake_compile) == 1
    assert not list(library.parent.glob("*.tmp"))  # written under a temporary name, renamed


def test_the_key_changes_with_each_source_and_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = (tmp_path / "a.cpp", tmp_path / "b.cpp")
    for source in sources:
        source.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(build, "SOURCES", sources[:1])
    monkeypatch.setattr(build, "HEADERS", sources[1:])
    keys = {build.build_key("/usr/bin/true")}
    assert build.build_key("/usr/bin/true") in keys
    for source in sources:
        source.write_text(source.read_text() + "// changed\n")
        keys.add(build.build_key("/usr/bin/true"))
    assert len(keys) == 3


def test_no_compiler_and_a_failed_compile_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        build.ensure_built(tmp_path)
    monkeypatch.setattr(build, "_compiler", lambda: "/bin/false")
    with pytest.raises(RuntimeError, match="/bin/false failed"):
        build.ensure_built(tmp_path)
    assert not list((tmp_path / "kernels").glob("*/*.so*"))  # nothing half-written left
