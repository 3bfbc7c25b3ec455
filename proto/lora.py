"""A LoRA adapter as it travels with a request (frontend -> scheduler -> worker).

`LoRARequest(lora_name, lora_int_id, lora_path)` is also the offline API's argument
(`LLM.generate(..., lora_request=...)`, exported as `kvflow.LoRARequest`). The int id
names the adapter everywhere past the frontend: the scheduler counts distinct ids per
step and keys the prefix cache by it, the worker keys its adapter caches by it. The
path travels too, so a worker that has never seen the adapter can load it.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    lora_name: str
    lora_int_id: int  # > 0: one adapter per id for the engine's lifetime
    lora_path: str = ""  # the PEFT directory (adapter_config.json + safetensors)
    base_model_name: str | None = None  # the model it was trained on (shown, not checked)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
