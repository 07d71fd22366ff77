"""Test configuration: hypothesis profiles, and ``gpu``/``slow`` markers that skip with a reason."""
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
    """``gpu`` tests skip without a CUDA GPU; ``slow`` tests (minutes on the CI machine) run only with
    FOSCAR_SLOW=1. Each skip says why."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    slow = pytest.mark.skip(reason="slow (minutes on a CPU): set FOSCAR_SLOW=1 to run it")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and os.environ.get("FOSCAR_SLOW") != "1":
            item.add_marker(slow)

# The references are loops of small tensor ops: extra threads only wait on each other (up to 100x
# slower on a busy 2-core CI machine).
torch.set_num_threads(1)



@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """Each test chooses its backend afresh: some replace the status checks (monkeypatch), and the API
    caches its choices per process (:func:`foscar.api.clear_selection_cache`)."""
    from foscar.api import clear_selection_cache
    clear_selection_cache()
    yield
    clear_selection_cache()
