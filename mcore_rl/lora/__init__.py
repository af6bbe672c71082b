"""LoRA adapters on the frozen base's linears: settings (``config``), the adapter layers inside
megatron's parallel linears (``layers``) and attaching them while a model is built, from seeds
or a PEFT adapter directory (``build``). A room between ``mapping`` and ``models``: it imports
neither ``models`` nor anything above. The PEFT tensor mapping lives with the other mappings
(``mapping/peft*.py``); exports of a live LoRA model (PEFT adapter, merged HF weights) with the
other conversions (``conversion/lora_export.py``)."""
