"""ModelRunner pieces that need no model: the decode input buffers and step inputs."""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm.core.sampling import PendingTokens
from nanovllm.core.step_inputs import DecodeBuffers, StepInput


def _expected_rows(step: StepInput, bs: int, width: int, block_size: int):
    n = len(step.token_ids)
    tables = torch.full((bs, width), -1, dtype=torch.int32)
    for i, row in enumerate(step.block_tables):
        tables[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    slots = [step.block_tables[i][p // block_size] * block_size + p % block_size
             for i, p in enumerate(step.start_pos)]
    pad = bs - n
    src = step.src_rows if step.src_rows is not None else [-1] * n
    return ([t[0] for t in step.token_ids] + [0] * pad, list(step.start_pos) + [0] * pad, slots + [-1] * pad,
            [p + 1 for p in step.start_pos] + [0] * pad, list(src) + [-1] * pad, tables)


def test_decode_buffers_load_every_field_and_clear_stale_rows():
    rng = random.Random()
    max_bs, width, block_size = 16, 6, 4
    buf = DecodeBuffers(max_bs, width, block_size, torch.device("cpu"), pin=False)
    for _ in range(30):  # consecutive loads: rows left over from a bigger step must not leak
        n = rng.randint(1, max_bs)
        bs = rng.randint(n, max_bs)
        tables, pos = [], []
        for _ in range(n):
            p = rng.randint(0, width * block_size - 1)
            pos.append(p)
            tables.append(rng.sample(range(100), p // block_size + 1))
        src = [rng.choice([-1, rng.randint(0, max_bs - 1)]) for _ in range(n)] if rng.random() < 0.5 else None
        step = StepInput(False, [[rng.randint(0, 999)] for _ in range(n)], pos, tables, src)
        buf.device.fill_(-7)  # poison: everything the step reads must be written by load()
        got = buf.load(step, bs)
        want = _expected_rows(step, bs, width, block_size)
        for name, g, w in zip(("ids", "pos", "slots", "ctx", "src"), got[:5], want[:5]):
            assert g.tolist() == w, name
        assert torch.equal(got[5], want[5])


def test_step_input_marks_tokens_still_on_the_device():
    from nanovllm.core.scheduler import ScheduledBatch
    from nanovllm.core.sequence import PENDING_TOKEN, Sequence
    from nanovllm.sampling_params import SamplingParams

    a = Sequence(0, [1, 2, 3], SamplingParams(), 0)
    b = Sequence(1, [4, 5], SamplingParams(), 0)
    for s in (a, b):
        s.num_cached_tokens = len(s) - 1
        s.block_table = [s.seq_id]
    assert StepInput.from_batch(ScheduledBatch([a, b], [1, 1], False)).src_rows is None
    b.token_ids[-1] = PENDING_TOKEN
    b.pending_row = 3
    step = StepInput.from_batch(ScheduledBatch([a, b], [1, 1], False))
    assert step.src_rows == [-1, 3] and step.token_ids == [[3], [PENDING_TOKEN]]


def test_pending_tokens_reads_only_its_rows():
    host = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    assert PendingTokens(host, 3, None).result() == [5, 6, 7]


class _NeverDone:
    """A CUDA event stand-in whose work never finishes (a collective waiting for a dead peer)."""

    def query(self):
        return False

    def synchronize(self):
        raise AssertionError("a checked wait must poll, not block")


class _Done(_NeverDone):
    def query(self):
        return True


def test_pending_tokens_with_a_check_stop_waiting_once_it_raises():
    host = torch.tensor([7, 8, 9], dtype=torch.int32)
    calls = []

    def check():
        calls.append(1)
        if len(calls) >= 5:
            raise RuntimeError("worker 1 died")

    with pytest.raises(RuntimeError, match="worker 1"):
        PendingTokens(host, 2, _NeverDone(), check).result()
    assert len(calls) == 5
    # Completed, but the peer died meanwhile: the tokens may be garbage, so they are not returned.
    calls.extend([1] * 10)
    with pytest.raises(RuntimeError, match="worker 1"):
        PendingTokens(host, 2, _Done(), check).result()
    assert PendingTokens(host, 2, _Done(), lambda: None).result() == [7, 8]
    assert PendingTokens(host, 3, None, lambda: None).result() == [7, 8, 9]


def test_preferred_blas_switches_for_the_block_and_restores_after_an_error(monkeypatch):
    from nanovllm.core import cuda_graphs as model_runner

    current = ["cublas"]
    calls = []

    def fake(backend=None):
        if backend is not None:
            calls.append(backend)
            current[0] = backend
        return current[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", fake)
    with model_runner.preferred_blas("cublaslt"):
        assert current[0] == "cublaslt"
    assert current[0] == "cublas"
    with pytest.raises(RuntimeError, match="capture failed"):
        with model_runner.preferred_blas("cublaslt"):
            raise RuntimeError("capture failed")
    assert current[0] == "cublas"
    assert calls == ["cublaslt", "cublas", "cublaslt", "cublas"]
