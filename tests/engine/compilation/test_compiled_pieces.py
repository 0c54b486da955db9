"""-O3's torch.compile'd pieces: the same tokens as eager, and a second start compiles nothing.

Each start is its own process (Inductor's in-memory caches would otherwise hide a cold disk
cache), sharing one cache root; the child prints what Inductor compiled and found cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve.engine.compilation.pieces import CompiledPieces

pytestmark = pytest.mark.slow

_CHILD = """
import json, sys
from fleetserve import LLM, SamplingParams
from fleetserve.engine.compilation.pieces import compile_counts
llm = LLM(sys.argv[1], dtype="float32", optimization_level=int(sys.argv[2]), max_model_len=256,
          num_kv_blocks=128)
started = compile_counts()
prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(200)]} for i in range(2)]
prompts.append({"prompt_token_ids": [11, 12, 13]})  # a small step: below the compile range
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
served = compile_counts()
print(json.dumps({"start": [started.compiled, started.cache_hits],
                  "after": [served.compiled, served.cache_hits],
                  "tokens": [list(o.outputs[0].token_ids) for o in out]}))
"""


def _start(model: Path, level: int, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "FLEETSERVE_CACHE": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), str(level)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_second_start_compiles_nothing_and_tokens_equal_eager(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    first = _start(tiny_llama_dir, 3, tmp_path)
    compiled, hits = first["start"]
    assert compiled > 0 and hits == 0, first
    assert first["after"] == first["start"], "serving compiled again after the warm-up"
    second = _start(tiny_llama_dir, 3, tmp_path)
    assert second["start"] == [0, compiled], second  # every graph a cache hit, none compiled
    assert second["after"] == second["start"]
    eager = _start(tiny_llama_dir, 2, tmp_path)
    assert eager["start"] == [0, 0]  # -O2 compiles nothing
    assert first["tokens"] == second["tokens"] == eager["tokens"]
    assert list((tmp_path / "compile").iterdir()), "the cache lives under the fleetserve cache"


def test_the_compile_range_is_on_the_token_count(tmp_path: Path) -> None:
    pieces = CompiledPieces(256, tmp_path, ("float32",))
    assert not pieces.applies(255) and pieces.applies(256) and pieces.applies(4096)
    other = CompiledPieces(256, tmp_path, ("bfloat16",))
    assert other.cache_dir != pieces.cache_dir  # the key separates what changes the code
    with pytest.raises(ValueError, match="compile_min_tokens must be > 0"):
        CompiledPieces(0, tmp_path, ())
    x, residual, weight = torch.randn(300, 64), torch.randn(300, 64), torch.rand(64)
    normed, summed = pieces.rms_norm(x, weight, 1e-6, residual)
    reference = (x + residual) * torch.rsqrt((x + residual).pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, weight * reference)
    torch.testing.assert_close(summed, x + residual)
