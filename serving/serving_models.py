"""Which model a request names (vLLM's OpenAIServingModels): the base model under its served names, or a LoRA
adapter by its name, for every front end (HTTP ``model``, gRPC ``lora_name``).

Adapters come from ``--lora-modules`` at start-up and from ``/v1/load_lora_adapter`` at run time; each gets an id
of its own that is never reused (the id keys the engine's host LRU, device slots and prefix cache, so an adapter
loaded again under an old name never meets the old one's weights or KV blocks). Unloading forgets the name at once:
new requests naming it are refused, requests already running finish with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging

from jaxpage.lora.request import LoRARequest
from serving.requests import InvalidRequestError, RequestLifecycle

log = logging.getLogger("jaxpage.serve")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): an adapter's name, its PEFT directory, and the base model it
    reports as ``parent`` (default: the served model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or the JSON ``{"name": ..., "path": ..., "base_model_name": ...}``, as vLLM's flag."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not JSON ({e})") from None
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"}) if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or unknown or not entry.get("name") or not entry.get("path"):
            raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} needs 'name' and 'path' (and may have "
                                             f"'base_model_name')" + (f", not {unknown}" if unknown else ""))
        return LoRAModulePath(entry["name"], entry["path"], entry.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not name=path or a JSON object")
    return LoRAModulePath(name, path)


class UnknownModelError(InvalidRequestError):
    """The request names a model that is neither the base model nor a loaded adapter."""


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a request runs on: its model name as responses carry it, and the adapter (None: the base model)."""

    name: str
    lora_request: LoRARequest | None = None


@dataclasses.dataclass(frozen=True)
class Adapter:
    lora_request: LoRARequest
    base_model_name: str | None


class ServingModels:
    def __init__(self, requests: RequestLifecycle, served_model_names: list[str] | None = None,
                 lora_modules: list[LoRAModulePath] | None = None):
        self.requests = requests
        self.served_model_names = served_model_names
        self._ids = itertools.count(1)
        self.adapters: dict[str, Adapter] = {}
        for module in lora_modules or []:
            self._register(module.name, module.path, module.base_model_name)

    def base_names(self, engine=None) -> list[str]:
        """The base model's names (--served-model-name, or the model's own: engine's, else the serving one's)."""
        return self.served_model_names or [(engine or self.requests.require_engine()).engine.model_name]

    def resolve(self, model: str | None, field: str = "model") -> ServedModel:
        """The model a request names in ``field`` (None or empty: the base model); UnknownModelError naming the
        field for any other name."""
        names = self.base_names()
        if not model or model in names:
            return ServedModel(model or names[0])
        adapter = self.adapters.get(model)
        if adapter is None:
            served = [*names, *self.adapters]
            raise UnknownModelError(f"{field}={model!r}: the model {model!r} does not exist; this server serves "
                                    f"{', '.join(map(repr, served))}")
        return ServedModel(model, adapter.lora_request)

    def parent(self, adapter: Adapter) -> str:
        return adapter.base_model_name or self.base_names()[0]

    async def check_all(self, engine, restart: bool = False) -> None:
        """Reads every registered adapter into a fresh engine. At start-up a bad one raises ValueError; after a
        restart (its files changed meanwhile) it is served no more, so that the server still comes back."""
        clash = sorted(set(self.adapters) & set(self.base_names(engine)))
        if clash:
            raise ValueError(f"--lora-modules: {clash} is the base model's name too")
        for name, adapter in list(self.adapters.items()):
            try:
                await engine.add_lora(adapter.lora_request)
            except ValueError as e:
                if not restart:
                    raise ValueError(f"--lora-modules {name}: {e}") from None
                log.error("LoRA adapter %r is served no more: %s", name, e)
                self.adapters.pop(name, None)

    async def load(self, name: str, path: str) -> None:
        """/v1/load_lora_adapter: the adapter read and checked by the engine, then served under ``name``; a name
        in use or a bad adapter is an InvalidRequestError (naming the file and field)."""
        if not name or not path:
            raise InvalidRequestError("both lora_name and lora_path must be given")
        if name in self.adapters or name in self.base_names():
            raise InvalidRequestError(f"lora_name={name!r}: the adapter {name!r} has already been loaded")
        request = LoRARequest(name, next(self._ids), path)
        try:
            await self.requests.require_engine().add_lora(request)
        except ValueError as e:
            raise InvalidRequestError(f"lora_path={path!r}: {e}") from None
        if name in self.adapters:  # loaded meanwhile by a concurrent call
            raise InvalidRequestError(f"lora_name={name!r}: the adapter {name!r} has already been loaded")
        self.adapters[name] = Adapter(request, None)

    async def unload(self, name: str) -> None:
        """/v1/unload_lora_adapter: ``name`` is served no more; the engine forgets the adapter once no request
        runs with it (UnknownModelError for a name not loaded)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise UnknownModelError(f"lora_name={name!r}: the adapter {name!r} cannot be found")
        engine = self.requests.engine
        if engine is not None:
            await engine.remove_lora(adapter.lora_request.lora_int_id)

    def _register(self, name: str, path: str, base_model_name: str | None) -> None:
        if name in self.adapters:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        self.adapters[name] = Adapter(LoRARequest(name, next(self._ids), path), base_model_name)
