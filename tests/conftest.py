"""Shared test set-up.

- Triton kernels run under the interpreter when there is no GPU.
- Every test starts from a fresh random seed (new each session, the same in every xdist worker, printed in
  the header and after the results); set SPARSEFLASH_TEST_SEED to replay a failing run.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_SEED = int(os.environ.get("SPARSEFLASH_TEST_SEED", random.SystemRandom().randrange(2**31)))
# pytest-xdist's workers start from this process's environment: every worker draws from the seed printed here
os.environ["SPARSEFLASH_TEST_SEED"] = str(SESSION_SEED)


def _seed_line() -> str:
    return f"sparseflash test seed: {SESSION_SEED} (replay with SPARSEFLASH_TEST_SEED={SESSION_SEED})"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # again at the end, where -q (make test) shows it too, beside the failures it replays
    terminalreporter.write_line(_seed_line())


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
