"""LoRARequest, vLLM's: which adapter a request runs with."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) under a name and an
    id; the id is the adapter's identity in the engine (its device slot, its prefix-cache keys), >= 1."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an integer >= 1")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
