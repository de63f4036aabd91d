"""Shared pieces of the scale-out tests (test_data_parallel.py, test_ray_backend.py,
test_external_launcher.py): the prompts and parameters every backend must agree on, a deadline
for multi-process tests, and process checks."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

from nanovllm import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts() -> list[list[int]]:
    """Prompts of different lengths (so the sharding is uneven), two sharing a prefix."""
    shared = list(range(100, 140))
    return [[5, 6, 7], [1] * 20, shared + [3, 4], shared + [9], list(range(200, 260)), [42] * 7, [8, 9]]


def mixed_params() -> list[SamplingParams]:
    """One per prompt: greedy, seeded sampling with n > 1, a filter (top-p), logprobs and a
    penalty (the paths where rank 0 samples alone under tensor parallelism)."""
    return [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=3, seed=11),
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True, seed=5, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, n=2, seed=3),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=99)]


def completions(outs) -> list[list[list[int]]]:
    """Every completion's tokens, per prompt, in sample order."""
    return [[c.token_ids for c in o.outputs] for o in outs]


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """TimeoutError in the main thread if the block runs longer than `seconds` (a hung
    multi-process test fails instead of stalling CI)."""
    def expired(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def no_children(timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while mp.active_children() and time.monotonic() < end:
        time.sleep(0.1)
    return not mp.active_children()


def gone(pids, timeout: float = 10.0) -> bool:
    """Whether every process in `pids` has exited (within `timeout`)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent counts as gone
                    if f.read().split(") ", 1)[1].startswith("Z"):
                        continue
                alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False
