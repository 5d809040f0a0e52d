"""Multi-LoRA (vLLM's vllm/lora): adapter requests, PEFT adapters read into the device slots' layout, and the
runner's bookkeeping of which adapter sits in which slot. The device half (a Linear's slots, the per-token
delta) is jaxpage.models.lora_slots."""
