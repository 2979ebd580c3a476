"""Shared pytest configuration: hypothesis profiles sized for a 2-core machine, shared fixtures."""
import os
import signal

import pytest
from hypothesis import HealthCheck, settings

# Shared machines are noisy: no per-example deadline. "ci" is the default profile.
settings.register_profile(
    "ci", deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True)
settings.register_profile(
    "dev", deadline=None, max_examples=15,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("NXHPC_HYPOTHESIS_PROFILE", "ci"))

# A suite started as a background job of a script (`cmd &`, nohup) inherits SIGINT ignored, and
# so would every CLI it starts (an ignored signal stays ignored across exec, and the CLIs, like
# Python, leave an ignored SIGINT alone): the Ctrl-C tests would wait for a signal no one takes.
# Their children must start as from a terminal, so this process takes SIGINT back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def torch_threads():
    """torch at 2 intra-op threads (this machine's cores) for a module's oracle runs, restored
    after. Modules that run torch take it with ``pytestmark = pytest.mark.usefixtures(...)``."""
    torch = pytest.importorskip("torch")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    """A module's own models directory (built-ins are generated there on first use)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def tiny(models_root):
    """The built-in ``tiny`` block model, opened from the module's models directory."""
    from nxhpc.models import open_model
    return open_model("tiny", models_dir=models_root)
