"""Shared test set-up.

- Triton kernels run under the interpreter when there is no GPU.
- Every test starts from a fresh random seed (new each session, printed in the header); set
  SPARSEFLASH_TEST_SEED to replay a failing run.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_SEED = int(os.environ.get("SPARSEFLASH_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"sparseflash test seed: {SESSION_SEED} (replay with SPARSEFLASH_TEST_SEED={SESSION_SEED})"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    torch.manual_seed(SESSION_SEED + sum(map(ord, request.node.nodeid)))
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
