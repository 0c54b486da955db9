"""The served model names, base and LoRA adapters, and the routes that change them at run time.

`LoRAModels` maps a request's `model` to what the engine runs: the base model's name → no
adapter, an adapter's name → its `LoRARequest` (the id the worker's caches key on, the folder
it loads from). The adapters of `--lora-modules` are registered at start-up; with
`FLEETSERVE_ALLOW_RUNTIME_LORA_UPDATING=1` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` add and remove adapters, with
vLLM's bodies and answers. Loading only registers the adapter (its folder is checked here,
torch-free); the worker reads its weights when a batch first needs it.

An adapter name keys its requests' prefix-cache blocks (`common.block_hash`), so a name is
bound to one folder for the server's life: loading a name again from another folder after
unloading it is refused (its old blocks could otherwise be hit with the new weights).
"""

from __future__ import annotations

from aiohttp import web

from fleetserve.engine.lora.config import LoRAConfig
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.openai.errors import RequestError, parse_body
from fleetserve.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    UnloadLoRAAdapterRequest,
)

__all__ = ["LORA_MODELS_KEY", "MAX_LORA_ADAPTERS", "LoRAModels", "add_lora_routes"]

MAX_LORA_ADAPTERS = 1024
"""Adapters one server registers at most (a load beyond it is a 400)."""


class LoRAModels:
    """The base model's name and the registered adapters (one event loop: no locking).

    Args:
        base_name: the served model name (`--served-model-name`).
        base_root: the base model's folder (each card's `root`, the adapters' `parent`).
        lora: the engine's LoRA settings (None: no adapters, and the routes refuse).
        allow_runtime_updates: whether the load/unload routes may change the adapters.
    """

    def __init__(
        self,
        base_name: str,
        base_root: str,
        max_model_len: int,
        lora: LoRAConfig | None,
        *,
        allow_runtime_updates: bool = False,
    ) -> None:
        self.base_name = base_name
        self.base_root = base_root
        self.max_model_len = max_model_len
        self.lora = lora
        self.allow_runtime_updates = allow_runtime_updates
        self._adapters: dict[str, LoRARequest] = {}
        self._paths: dict[str, str] = {}
        """Every name ever registered → its folder (a name keeps its folder; see module doc)."""
        self._next_id = 1
        for module in lora.lora_modules if lora is not None else ():
            self._register(module.name, module.path)

    @property
    def names(self) -> list[str]:
        """The names a request's `model` may take: the base model first, then the adapters."""
        return [self.base_name, *self._adapters]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model, or no model given).

        Raises:
            RequestError: 400 `model_not_found` naming the served models.
        """
        if model is None or model == self.base_name:
            return None
        adapter = self._adapters.get(model)
        if adapter is None:
            # NOTE: vLLM answers 404; our contract (issue 3) treats an unknown model as bad
            # input like any other field, so 400, with OpenAI's code so clients can tell.
            known = ", ".join(f"'{name}'" for name in self.names)
            raise RequestError(
                400,
                f"model must be one of [{known}], got `{model}`",
                param="model",
                code="model_not_found",
            )
        return adapter

    def cards(self) -> list[ModelCard]:
        """/v1/models: the base model, then each adapter with `parent` = the base model."""
        base = ModelCard(id=self.base_name, root=self.base_root, max_model_len=self.max_model_len)
        adapters = [
            ModelCard(
                id=name,
                root=adapter.lora_path,
                parent=self.base_name,
                max_model_len=self.max_model_len,
            )
            for name, adapter in self._adapters.items()
        ]
        return [base, *adapters]

    def load(self, name: str, path: str) -> LoRARequest:
        """Register adapter `name` from `path` (checked: a PEFT folder within max_lora_rank).

        Raises:
            RequestError: 400 when runtime updates are off, LoRA is off, the name is taken
                (or was bound to another folder), the registry is full, or the folder is bad.
        """
        self._require_updates()
        if name == self.base_name or name in self._adapters:
            raise RequestError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        previous = self._paths.get(name)
        if previous is not None and previous != path:
            raise RequestError(
                400,
                f"lora_name '{name}' was served from {previous!r} before; prefix-cache blocks "
                f"are keyed by the name, so it cannot be reused for {path!r}: choose a new name",
                param="lora_name",
            )
        if len(self._adapters) >= MAX_LORA_ADAPTERS:
            raise RequestError(
                400,
                f"this server registers at most {MAX_LORA_ADAPTERS} LoRA adapters; unload one",
                param="lora_name",
            )
        return self._register(name, path)

    def unload(self, name: str, lora_int_id: int | None = None) -> None:
        """Forget adapter `name` (requests running under it finish; new ones are refused).

        Raises:
            RequestError: 400 when runtime updates are off, 404 for an unknown name, 400 when
                `lora_int_id` is given and is not the adapter's.
        """
        self._require_updates()
        adapter = self._adapters.get(name)
        if adapter is None:
            raise RequestError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                param="lora_name",
                code="model_not_found",
            )
        if lora_int_id is not None and lora_int_id != adapter.lora_int_id:
            raise RequestError(
                400,
                f"lora_int_id must be {adapter.lora_int_id} (the id of '{name}'), got {lora_int_id}",
                param="lora_int_id",
            )
        del self._adapters[name]

    def _register(self, name: str, path: str) -> LoRARequest:
        assert self.lora is not None
        try:
            self.lora.check_adapter(name, path)
        except ValueError as exc:
            raise RequestError(400, str(exc), param="lora_path") from exc
        adapter = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._adapters[name] = adapter
        self._paths[name] = path
        return adapter

    def _require_updates(self) -> None:
        if self.lora is None:
            raise RequestError(
                400, "this server runs without --enable-lora, so it serves no LoRA adapters"
            )
        if not self.allow_runtime_updates:
            raise RequestError(
                400,
                "runtime LoRA updates are off: set FLEETSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 to "
                "load and unload adapters while serving (or list them with --lora-modules)",
            )


LORA_MODELS_KEY = web.AppKey("lora_models", LoRAModels)


async def _load(request: web.Request) -> web.Response:
    body = await parse_body(request, LoadLoRAAdapterRequest)
    adapter = request.app[LORA_MODELS_KEY].load(body.lora_name, body.lora_path)
    return web.Response(
        text=f"Success: LoRA adapter '{adapter.lora_name}' added successfully.",
        content_type="text/plain",
    )


async def _unload(request: web.Request) -> web.Response:
    body = await parse_body(request, UnloadLoRAAdapterRequest)
    request.app[LORA_MODELS_KEY].unload(body.lora_name, body.lora_int_id)
    return web.Response(
        text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
        content_type="text/plain",
    )


def add_lora_routes(app: web.Application) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (the app must hold a
    `LoRAModels` under `LORA_MODELS_KEY` before it serves)."""
    app.router.add_post("/v1/load_lora_adapter", _load)
    app.router.add_post("/v1/unload_lora_adapter", _unload)
