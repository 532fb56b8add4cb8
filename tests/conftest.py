"""Suite-wide: a test that leaves this process's Ctrl-C handler changed fails (a guardian's on_signal left behind by an
in-process Guardian.run took the next test's simulated Ctrl-C, and that test failed only in the full suite). Compared
with the handler before the test: a suite started in the background inherits SIGINT ignored."""
import signal

import pytest


@pytest.fixture(autouse=True)
def ctrl_c_handler_put_back(request):
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    assert after is before, f"{request.node.nodeid} left the SIGINT handler {after} (was {before})"
