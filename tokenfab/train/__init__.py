"""Fine-tuning (issue 18): data and packing (``data``), LoRA and PEFT-format files (``lora``), the
Hugging Face model with our training kernels patched in (``model``), the loop (``trainer``),
checkpoints (``checkpoint``), FSDP2 (``distributed``) and ``tokenfab finetune`` (``cli``)."""
