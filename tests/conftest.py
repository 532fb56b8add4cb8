"""Suite-wide: a test that leaves this process's Ctrl-C handler changed fails (a guardian's on_signal left behind by an
in-process Guardian.run took the next test's simulated Ctrl-C, and that test failed only in the full suite). Compared
with the handler before the test."""
import signal

import pytest

# a suite started in the background by a shell without job control inherits SIGINT ignored: Python then never raises
# KeyboardInterrupt, in this process or the scripts it starts (they inherit the ignore), and every Ctrl-C test fails
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def ctrl_c_handler_put_back(request):
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    assert after is before, f"{request.node.nodeid} left the SIGINT handler {after} (was {before})"


# files of long subprocess tests first: the run then ends on short tests instead of one worker idle while the other
# finishes a 45 s one (files stay whole, so module-scoped fixtures are built once per worker as before)
LONG_FIRST = ["test_faults.py", "test_train.py", "test_stream_infer.py", "test_relay.py", "test_chat.py",
              "test_arm_kernels.py", "test_data.py", "test_eval.py", "test_chunk_pool.py", "test_model.py"]


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONG_FIRST.index(item.path.name) if item.path.name in LONG_FIRST else len(LONG_FIRST))
