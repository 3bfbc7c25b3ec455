"""The adapters a frontend serves by name: `model` in a request picks one.

    --lora-modules name=path ...        loaded (checked) at start; a bad one stops the start
    POST /v1/load_lora_adapter          checked now: a bad adapter is a 4xx, nothing changes
    POST /v1/unload_lora_adapter        refused (409) while requests of it are in flight

Each adapter's int id is derived from its name and path (`stable_lora_id`), so several
frontends give one adapter the same id without talking to each other. The files are
checked here (config and safetensors header, `kvflow/lora_files.py`); the workers
read the tensors when a step first needs them. Unloading removes the name for new
requests; it is refused while this frontend still has requests of it in flight (the
client retries once they are done), so no request loses its adapter half-way.
"""

from __future__ import annotations

from collections import Counter
from http import HTTPStatus
from pathlib import Path

from kvflow.errors import ConfigError, LoRAAdapterError, ModelNotFoundError
from kvflow.lora_config import LoRAConfig, stable_lora_id
from kvflow.lora_files import LoRAAdapterCheck
from kvflow.proto.lora import LoRARequest
from kvflow.services.frontend.errors import APIError


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, model_dir: str, base_name: str) -> None:
        self.config = config or LoRAConfig()
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._in_flight: Counter[str] = Counter()
        self._check = (
            LoRAAdapterCheck(self.config, Path(model_dir)) if self.config.enable_lora else None
        )
        for module in self.config.lora_modules:
            try:
                self.load(module.name, module.path, module.base_model_name)
            except LoRAAdapterError as exc:
                raise ConfigError(f"--lora-modules {module.name}: {exc}") from None

    @property
    def runtime_updates_allowed(self) -> bool:
        return self.config.enable_lora and self.config.runtime_updates_allowed

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = ", ".join([self.base_name, *self.adapters])
            raise ModelNotFoundError(
                f"model not found: the model {model!r} does not exist; this server serves {served}"
            )
        return adapter

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if self._check is None:
            raise LoRAAdapterError("this server was started without --enable-lora")
        if not name or name == self.base_name or name in self.adapters:
            raise LoRAAdapterError(f"the name {name!r} is already served", param="lora_name")
        resolved = str(self.config.check_path(path))
        adapter = LoRARequest(name, stable_lora_id(name, resolved), resolved, base_model_name)
        self._check.check(adapter)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ModelNotFoundError(f"model not found: no LoRA adapter named {name!r}")
        if self._in_flight[name]:
            raise APIError(
                HTTPStatus.CONFLICT,
                f"LoRA adapter {name!r} is in use by {self._in_flight[name]} request(s); "
                "unload it once they are done",
                error_type="conflict_error",
                param="lora_name",
            )
        del self.adapters[name]

    def acquire(self, adapter: LoRARequest | None) -> None:
        if adapter is not None:
            self._in_flight[adapter.lora_name] += 1

    def release(self, adapter: LoRARequest | None) -> None:
        if adapter is not None:
            self._in_flight[adapter.lora_name] -= 1
            if not self._in_flight[adapter.lora_name]:
                del self._in_flight[adapter.lora_name]
