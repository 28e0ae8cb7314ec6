"""LoRA adapters served beside the base model: read from PEFT folders, kept in host memory and
device slots, mixed with base-model rows in one batch (docs/lora.md)."""
