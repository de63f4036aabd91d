"""Tests for the fused all-reduce + residual + RMSNorm kernel (nanovllm/kernels/all_reduce.py).

The ranks are simulated in one process: each "rank" has its own staging buffer, flag pad and
call counter, and the pointer tables hold their addresses, exactly as symmetric memory would
give them. Without CUDA the kernel runs through Triton's interpreter one call at a time, so a
rank's peers are made to have "arrived" beforehand (rows staged, flags raised) and the test
checks the flags the call leaves behind. On a GPU the ranks run concurrently on two streams,
which exercises the real barrier. The reference is the sum of the partial rows followed by the
plain-torch RMSNorm layer. Inputs are fresh random numbers each run; outputs start as NaN.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from nanovllm.kernels.all_reduce import all_reduce_rms_norm, wait_count
from nanovllm.model.layers.layernorm import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


pytestmark = pytest.mark.usefixtures("fresh_seed")  # tests/conftest.py


class Ranks:
    """`world` simulated ranks' symmetric state on one device."""

    def __init__(self, world: int, hidden: int, max_rows: int, programs: int, dtype, device=DEVICE):
        self.world, self.hidden, self.max_rows, self.programs = world, hidden, max_rows, programs
        self.bufs = [torch.zeros(2, max_rows, hidden, dtype=dtype, device=device) for _ in range(world)]
        self.flags = [torch.zeros(programs, world, dtype=torch.int32, device=device) for _ in range(world)]
        self.phase = [torch.zeros(programs, dtype=torch.int32, device=device) for _ in range(world)]
        self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=device == "cuda")
        addresses = [t.data_ptr() for t in self.bufs + self.flags] + [self.abort_word.data_ptr()]
        self.addresses = torch.tensor(addresses, dtype=torch.int64, device=device)

    def call(self, rank, x, residual, weight):
        return all_reduce_rms_norm(x, residual, weight, EPS, addresses=self.addresses, phase=self.phase[rank],
                                   max_rows=self.max_rows, rank=rank, world_size=self.world)

    def peers_arrive(self, rank, parts, half):
        """What the other ranks' calls would have done before `rank` reaches the barrier."""
        for q in range(self.world):
            if q != rank:
                self.bufs[q][half, :parts[q].shape[0]] = parts[q]
                self.flags[rank][:, q] = 1
                self.flags[q][:, rank] = 0


def reference(parts, residual, norm):
    summed = sum(p.float() for p in parts).to(parts[0].dtype)
    return norm(summed, residual)


def make_inputs(world, rows, hidden, dtype, device=DEVICE):
    parts = [torch.randn(rows, hidden, device=device).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, device=device).to(dtype)
    norm = RMSNorm(hidden, eps=EPS).to(device)
    norm.weight.data = (1 + 0.2 * torch.randn(hidden, device=device)).to(dtype)
    return parts, residual, norm


def assert_close(out, ref):
    assert torch.isfinite(out).all(), "an element was left unwritten"
    tol = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}[out.dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (3, 2)])
def test_one_rank_sums_peers_and_normalises(dtype, world, rank):
    hidden, programs = 48, 3
    ranks = Ranks(world, hidden, max_rows=8, programs=programs, dtype=dtype)
    for call, rows in enumerate([5, 2, 8]):  # more and fewer rows than programs; both halves
        parts, residual, norm = make_inputs(world, rows, hidden, dtype)
        half = call % 2
        ranks.peers_arrive(rank, parts, half)
        y, new_residual = ranks.call(rank, parts[rank], residual, norm.weight)
        y_ref, res_ref = reference(parts, residual, norm)
        assert torch.equal(new_residual, res_ref)  # the same two roundings as the layers
        assert_close(y, y_ref)
        # This rank staged its rows in the half of this call, raised its flag on every peer
        # and consumed the peers' flags: the pads are ready for the next call.
        assert torch.equal(ranks.bufs[rank][half, :rows], parts[rank])
        for q in range(world):
            if q != rank:
                assert (ranks.flags[q][:, rank] == 1).all()
                assert (ranks.flags[rank][:, q] == 0).all()
        assert (ranks.phase[rank] == call + 1).all()


def test_call_counter_wraps_around():
    """After 2**31 calls the int32 counter wraps to negative values: the halves must still
    alternate (and stay inside the buffer)."""
    hidden, rank = 32, 0
    ranks = Ranks(2, hidden, max_rows=4, programs=2, dtype=torch.float32)
    for t in ranks.phase:
        t.fill_(2**31 - 2)
    for call in range(3):  # counters 2**31 - 2, 2**31 - 1, -2**31: halves 0, 1, 0
        parts, residual, norm = make_inputs(2, 3, hidden, torch.float32)
        half = call % 2
        ranks.peers_arrive(rank, parts, half)
        y, new_residual = ranks.call(rank, parts[rank], residual, norm.weight)
        y_ref, res_ref = reference(parts, residual, norm)
        assert torch.equal(new_residual, res_ref)
        assert_close(y, y_ref)
        assert torch.equal(ranks.bufs[rank][half, :3], parts[rank])
    assert (ranks.phase[rank] == -2**31 + 1).all()


def test_rows_beyond_the_buffer_are_rejected():
    ranks = Ranks(2, 16, max_rows=4, programs=2, dtype=torch.float32)
    parts, residual, norm = make_inputs(2, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="exceed"):
        ranks.call(0, parts[0], residual, norm.weight)


def test_layouts_the_kernel_cannot_read_are_rejected():
    ranks = Ranks(2, 16, max_rows=4, programs=2, dtype=torch.float32)
    parts, residual, norm = make_inputs(2, 3, 16, torch.float32)
    wide = torch.zeros(3, 32)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ranks.call(0, wide[:, ::2], residual, norm.weight)  # strided columns
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ranks.call(0, parts[0], wide[:, ::2], norm.weight)
    with pytest.raises(ValueError, match="do not match"):
        ranks.call(0, parts[0], residual, norm.weight.double())


def _run_in_thread(fn):
    done = threading.Event()
    errors = []

    def body():
        try:
            fn()
        except BaseException as e:  # reported by the test
            errors.append(e)
        done.set()

    threading.Thread(target=body, daemon=True).start()
    return done, errors


def test_abort_word_releases_a_rank_whose_peer_never_comes():
    """A dead peer never raises its flag: setting the abort word must end the wait."""
    ranks = Ranks(2, 16, max_rows=4, programs=2, dtype=torch.float32)
    parts, residual, norm = make_inputs(2, 3, 16, torch.float32)

    def call():
        ranks.call(0, parts[0], residual, norm.weight)
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    done, errors = _run_in_thread(call)
    assert not done.wait(1.0), "the call returned although its peer never arrived"
    ranks.abort_word[0] = 1
    assert done.wait(60), "the abort word did not release the waiting rank"
    assert not errors, errors
    assert (ranks.flags[1][:, 0] == 1).all()  # the raise went out before the wait


def prime(ranks, parts, residual, weight):
    """Run every rank's kernel once alone (the abort word releases its wait), then clear the
    state. CUDA loads a kernel's module lazily, at its first launch, and that load waits for
    the running kernels of the device: a first launch of rank 1 while rank 0 spins on the same
    GPU would wait forever."""
    ranks.abort_word[0] = 1
    for rank in range(ranks.world):
        ranks.call(rank, parts[rank], residual, weight)
        torch.cuda.synchronize()
    ranks.abort_word[0] = 0
    for t in ranks.flags + ranks.phase:
        t.zero_()


def finish_or_abort(ranks, timeout=30.0):
    """Wait for the device; past the deadline release the kernels through the abort word and
    fail with the flags' state, instead of hanging the test run."""
    done, errors = _run_in_thread(torch.cuda.synchronize)
    if done.wait(timeout):
        assert not errors, errors
        return
    ranks.abort_word[0] = 1
    released = done.wait(30)
    state = [f.tolist() for f in ranks.flags] if released else "the abort word did not release them"
    pytest.fail(f"the ranks' kernels did not meet within {timeout} s; flags: {state}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_ranks_concurrently_on_two_streams(dtype):
    """The real barrier: both ranks' kernels run at once and wait for each other, 40 calls in a
    row with changing row counts (the halves alternate, flags reset themselves)."""
    world, hidden = 2, 4096
    ranks = Ranks(world, hidden, max_rows=512, programs=16, dtype=dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]
    parts, residual, norm = make_inputs(world, 1, hidden, dtype)
    prime(ranks, parts, residual, norm.weight)
    for call in range(40):
        rows = random.choice([1, 7, 16, 255, 512])
        parts, residual, norm = make_inputs(world, rows, hidden, dtype)
        torch.cuda.synchronize()
        outs = []
        for rank, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs.append(ranks.call(rank, parts[rank], residual, norm.weight))
        finish_or_abort(ranks)
        y_ref, res_ref = reference(parts, residual, norm)
        for y, new_residual in outs:
            assert torch.equal(new_residual, res_ref)
            assert_close(y, y_ref)
        assert torch.equal(outs[0][0], outs[1][0])  # ranks must agree bitwise
    for f in ranks.flags:
        assert (f == 0).all()


@pytest.mark.gpu
def test_two_ranks_in_a_cuda_graph():
    """Captured once, replayed with new inputs: the counter on the device picks the half."""
    world, hidden, rows, dtype = 2, 1024, 64, torch.bfloat16
    ranks = Ranks(world, hidden, max_rows=rows, programs=8, dtype=dtype)
    parts, residual, norm = make_inputs(world, rows, hidden, dtype)
    streams = [torch.cuda.Stream() for _ in range(world)]

    prime(ranks, parts, residual, norm.weight)  # also compiles the kernels before the capture
    graphs, outs = [], []
    for rank, stream in enumerate(streams):  # capture each rank alone: no kernel runs while capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            outs.append(ranks.call(rank, parts[rank], residual, norm.weight))
        graphs.append(graph)
    for _ in range(5):
        for p in parts:
            p.copy_(torch.randn_like(p, dtype=torch.float32))
        torch.cuda.synchronize()
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
        finish_or_abort(ranks)
        y_ref, res_ref = reference(parts, residual, norm)
        for y, new_residual in outs:
            assert torch.equal(new_residual, res_ref)
            assert_close(y, y_ref)


# ----------------------------------------------------------------------------- wait_count


def _abort_address(abort_word):
    return torch.tensor([abort_word.data_ptr()], dtype=torch.int64, device=DEVICE)


def test_wait_count_returns_once_the_count_is_reached_or_aborted():
    abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=DEVICE == "cuda")
    count = torch.tensor([random.randint(1, 1000)], dtype=torch.int32, device=DEVICE)
    for target in (0, int(count)):  # reached: returns at once
        wait_count(count, target, _abort_address(abort_word))
    done, errors = _run_in_thread(lambda: (wait_count(count, int(count) + 1, _abort_address(abort_word), poll=4),
                                           torch.cuda.synchronize() if DEVICE == "cuda" else None))
    assert not done.wait(1.0), "returned although the count was never reached"
    abort_word[0] = 1
    assert done.wait(60), "the abort word did not end the wait"
    assert not errors, errors
    with pytest.raises(ValueError, match="int32"):
        wait_count(count.long(), 1, _abort_address(abort_word))
    with pytest.raises(ValueError, match="range"):
        wait_count(count, 2**31, _abort_address(abort_word))


@pytest.mark.gpu
def test_wait_count_holds_its_stream_until_another_stream_writes_the_count():
    """The copy-engine exchange's shape: the count arrives from another stream, later."""
    abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    address = _abort_address(abort_word)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    waiting, writing = torch.cuda.Stream(), torch.cuda.Stream()
    out = torch.zeros(1, device="cuda")
    # CUDA loads a kernel's module at its first launch, and the load waits for the running
    # kernels: a first launch while the wait spins would wait for the spin. So launch each first.
    wait_count(count, 0, address)
    torch.cuda._sleep(1)
    out.clone().fill_(0.0)
    count.fill_(0)
    torch.cuda.synchronize()
    result = {}

    def body():
        with torch.cuda.stream(waiting):
            wait_count(count, 3, address)
            out.fill_(1.0)  # must not run before the count is 3
        with torch.cuda.stream(writing):
            torch.cuda._sleep(50_000_000)  # ~25 ms: the waiting kernel is surely spinning by then
            result["before"] = out.clone()  # still 0 if the wait held the other stream
            count.fill_(3)
        torch.cuda.synchronize()

    done, errors = _run_in_thread(body)
    if not done.wait(30):
        abort_word[0] = 1
        pytest.fail("the wait did not see the count written by the other stream")
    assert not errors, errors
    assert result["before"].item() == 0.0 and out.item() == 1.0
