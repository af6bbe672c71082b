"""Imports megatron-core and transformers once so forked ranks (tests/dist.py) skip that cost."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import transformers  # noqa: E402,F401

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
