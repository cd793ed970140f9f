import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("TOME_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
