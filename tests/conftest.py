"""Session-wide fixtures: vLLM engines started through test_vllm_common.vllm_model are shared by every
test module that asks for the same (model, backend, options), and shut down when the session ends."""
import pytest


@pytest.fixture(scope="session", autouse=True)
def _close_shared_engines():
    yield
    import test_vllm_common
    for m in list(test_vllm_common._ENGINES.values()):
        test_vllm_common.drop(m)
