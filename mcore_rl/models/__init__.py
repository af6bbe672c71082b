"""Model construction on megatron-core: builder (GPTModel chunks), layer specs, HF config and weights.

A regular package (not a namespace package) so that ``find_packages`` ships it and the docs'
static analysis (griffe) finds its modules; nothing is imported here.
"""
