import os

import pytest
import torch

# Without a GPU the Triton kernels run through Triton's interpreter. It must be switched on
# before any kernel module is imported, which is why it lives here and not in the tests.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
