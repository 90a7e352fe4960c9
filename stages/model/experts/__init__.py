"""A mixture-of-experts model's routed experts: where they are (structure), LoRA on them (lora), NF4 storage under QLoRA (nf4)."""
