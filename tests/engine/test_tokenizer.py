"""`eos_token_ids`: the one reader of a model's end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fleetserve.engine.tokenizer import eos_token_ids


def _folder(tmp_path: Path, generation: dict[str, Any] | None) -> Path:
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_generation_config_wins_and_keeps_every_id(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"eos_token_id": [128001, 128009, 128001]})
    tokenizer: Any = SimpleNamespace(eos_token_id=5)
    assert eos_token_ids(folder, {"eos_token_id": 3}, tokenizer) == (128001, 128009)


def test_config_then_tokenizer(tmp_path: Path) -> None:
    tokenizer: Any = SimpleNamespace(eos_token_id=5)
    assert eos_token_ids(_folder(tmp_path, {}), {"eos_token_id": 3}, tokenizer) == (3,)
    assert eos_token_ids(_folder(tmp_path, {"eos_token_id": None}), {}, tokenizer) == (5,)
    assert eos_token_ids(tmp_path, {"eos_token_id": []}, None) == ()
