"""/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies).

Off unless the server runs with --allow-runtime-lora-updates or
KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=true (then 404, as when vLLM leaves them out); behind
the API key like every route. Success is vLLM's plain-text 200.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec
from starlette.responses import PlainTextResponse, Response

from kvflow.services.frontend.errors import APIError
from kvflow.services.frontend.lora_registry import LoRARegistry


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # accepted, as vLLM does; the name decides


def _check_allowed(registry: LoRARegistry) -> None:
    if not registry.runtime_updates_allowed:
        raise APIError(
            HTTPStatus.NOT_FOUND,
            "runtime LoRA updates are off: start the server with --enable-lora and "
            "--allow-runtime-lora-updates (or KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=true)",
            error_type="not_found_error",
        )


def load_lora_adapter(registry: LoRARegistry, body: bytes) -> Response:
    _check_allowed(registry)
    request = msgspec.json.decode(body, type=LoadLoRAAdapterRequest)
    registry.load(request.lora_name, request.lora_path, request.base_model_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


def unload_lora_adapter(registry: LoRARegistry, body: bytes) -> Response:
    _check_allowed(registry)
    request = msgspec.json.decode(body, type=UnloadLoRAAdapterRequest)
    registry.unload(request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
