"""Test configuration: hypothesis profiles and a GPU marker that skips with a reason."""
import os

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on CPU-only machines
    os.environ.setdefault("TRITON_INTERPRET", "1")

# "ci": derandomized (reproducible on a clean clone); "dev": fresh random examples each run;
# "long": a longer fuzz run (HYPOTHESIS_PROFILE=long pytest tests/test_fold.py).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.register_profile("long", max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); run on the GPU machine before resolving")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# The references are loops of small tensor ops: extra threads only wait on each other (up to 100x
# slower on a busy 2-core CI machine).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (minutes on the CI machine) run only with FOSCAR_SLOW=1."""
    import os
    if os.environ.get("FOSCAR_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set FOSCAR_SLOW=1 to run it (run before resolving)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
