"""LoRA adapters on the frozen base's linears: settings (``config``), the adapter layers inside
megatron's parallel linears (``layers``), attaching them while a model is built, from seeds or a
PEFT adapter directory (``build``), and exports as PEFT adapters or merged HF weights
(``export``). The PEFT tensor mapping lives with the other mappings (``mapping/peft*.py``)."""
