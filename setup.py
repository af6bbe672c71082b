"""mcore_rl: a Megatron-Core training backend for RL trainers (PPO, GRPO and kin)."""
from setuptools import find_packages, setup

setup(
    name="mcore_rl",
    version="0.1.0",
    description="Megatron-Core backend for RL trainers: actor/critic models, checkpoints, converters",
    packages=find_packages(include=["mcore_rl", "mcore_rl.*"]),
    package_data={"mcore_rl.integrations.verl": ["hydra/*/*.yaml"]},
    python_requires=">=3.11",
    install_requires=[
        # CPU machines: install torch==2.13.0 first (see constraints-cpu.txt); any other torch
        # request on such a machine pulls several GB of CUDA packages.
        "torch>=2.6",
        "megatron-core==0.16.1",
        "transformers>=5.0",
        "safetensors",
        "pyyaml",
        "omegaconf>=2.4",  # structured configs with Literal / tuple / Union annotations
        "psutil",  # megatron's async checkpoint writer needs it
        "xxhash>=3.4",  # checkpoint checksums (XXH3-128), computed while writing and while reading
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # gguf reads llama.cpp files (converters/gguf_to_hf.py); accelerate lets the tests compare
        # with transformers' own GGUF loader
        "gguf": ["gguf>=0.10"],
        # peft: the LoRA tests compare PEFT-format adapters with peft itself
        "test": ["pytest", "gguf>=0.10", "accelerate", "peft==0.21.2"],
        # the documentation site (mkdocs.yml, docs/): `make docs` builds it with --strict, first in
        # `make test`; mkdocstrings reads the docstrings by static analysis (griffe), importing nothing
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1.0,<2"],
        # Never part of the test command: it can pull a CUDA torch. NVIDIA apex is built from
        # source (see docs/getting-started.md); the PyPI package named `apex` is an unrelated project.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12"],
    },
    # verl loads its plug-ins at ``import verl``: ours adds a CPU platform (mcore_rl.integrations.verl)
    entry_points={"verl.plugins": ["mcore_rl = mcore_rl.integrations.verl.plugin"]},
)
