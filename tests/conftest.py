"""Session-wide fixtures: vLLM engines started through test_vllm_common.vllm_model are shared by every
test module that asks for the same (model, backend, options), and shut down when the session ends."""
import pytest


@pytest.fixture(scope="session", autouse=True)
def _close_shared_engines():
    yield
    import test_vllm_common
    for m in list(test_vllm_common._ENGINES.values()):
        test_vllm_common.drop(m)


@pytest.fixture(scope="module", autouse=True)
def _stop_reference_children():
    """A module that ran a side-install column (nnterp, validator/engines/child.py) leaves no child process
    to the next: one counting its own children would see it."""
    yield
    import sys
    child = sys.modules.get("validator.engines.child")
    if child is not None:
        child.stop_all()


@pytest.fixture
def ctrl_c():
    """SIGINT handled as Python handles it at a terminal (KeyboardInterrupt) for the test's length: a
    test runner started in the background (`cmd &` in a script, as CI may start it) inherits SIGINT
    ignored, and then a Ctrl-C test would see nothing."""
    import signal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
