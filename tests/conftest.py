"""Suite-wide: a test that leaves this process's Ctrl-C handler changed fails (a guardian's on_signal left behind by an
in-process Guardian.run took the next test's simulated Ctrl-C, and that test failed only in the full suite)."""
import signal

import pytest


@pytest.fixture(autouse=True)
def ctrl_c_handler_put_back(request):
    yield
    handler = signal.getsignal(signal.SIGINT)
    assert handler is signal.default_int_handler, f"{request.node.nodeid} left the SIGINT handler {handler}"
