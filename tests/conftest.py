import os
import random
import signal

import pytest
import torch

# A shell starting the suite as a background job without job control (`cmd &` in a script)
# hands it SIGINT ignored, and Python then keeps it so: every Ctrl-C test would see nothing.
# Those tests are about Python's own Ctrl-C (KeyboardInterrupt), so that is what they get.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Without a GPU the Triton kernels run through Triton's interpreter. It must be switched on
# before any kernel module is imported, which is why it lives here and not in the tests.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny GQA Qwen3 checkpoint most engine tests share (a module defining its own
    `ckpt` uses that one instead)."""
    from helpers import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory, "gqa")


@pytest.fixture(scope="module")
def llm(ckpt):
    """A CPU engine on `ckpt` with the tests' defaults (helpers.make_llm), one per module."""
    from helpers import make_llm

    return make_llm(ckpt)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test: collect garbage and return the CUDA cache. An engine a test drops
    without shutdown() (or one held by reference cycles) otherwise keeps its KV cache, sized
    from free memory, until the collector happens to run, and the next engine finds none left
    (the H200's suite ran out of memory so on 2026-12-01)."""
    yield
    if torch.cuda.is_available() and "gpu" in request.keywords:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def fresh_seed():
    """New random inputs every run, with the seed printed so a failure can be replayed."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return seed


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled float (and float8) tensors during the
    test, so a kernel that leaves part of its output unwritten fails instead of passing on
    whatever the allocator handed back."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (use with pytestmark): the tiny models' matmuls take
    microseconds, and on a busy 2-core machine OpenMP threads fighting for the cores make every
    step ~20x slower. Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
