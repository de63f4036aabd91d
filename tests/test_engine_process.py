"""EngineProcess: the server's engine loop in a child process (nanovllm/serve/engine_process.py).

The tokens it streams are compared with offline generate; its failure modes are: the model
cannot be built (the LLM's own error, raised in the parent), the child dies (every open request
is told), stop (every open request is told, no process left)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from helpers import BLOCK, greedy, make_llm, rand_ids, tiny_checkpoint

from nanovllm import SamplingParams
from nanovllm.serve.async_engine import Accepted, Delta, EngineRequest, EngineStopped, Failed, Finished
from nanovllm.serve.engine_process import EngineProcess

OPTIONS = dict(device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_num_seqs=8)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "gqa")


class Sinks:
    """Each request's events, in arrival order (delivered on the reader thread)."""

    def __init__(self):
        self.events: dict[int, list] = {}
        self.changed = threading.Condition()

    def sink(self, key: int):
        def put(event):
            with self.changed:
                self.events.setdefault(key, []).append(event)
                self.changed.notify_all()
        return put

    def wait(self, done, timeout: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not done(self.events):
                left = deadline - time.monotonic()
                assert left > 0, f"timed out: {self.events}"
                self.changed.wait(left)


def ended(events: list) -> bool:
    return bool(events) and isinstance(events[-1], (Finished, Failed))


def test_streams_the_tokens_of_offline_generate_and_frees_aborted_blocks(ckpt):
    prompts = [rand_ids(n, seed=i) for i, n in enumerate((5, 9, 14))]
    llm = make_llm(ckpt, **OPTIONS)
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    finally:
        llm.shutdown()
    sinks = Sinks()
    engine = EngineProcess(ckpt, OPTIONS)
    engine.start()
    try:
        assert engine.info.max_model_len > 0 and engine.stats.free_kv_blocks == engine.stats.num_kv_blocks
        requests = [EngineRequest(p, greedy(12), sinks.sink(i)) for i, p in enumerate(prompts)]
        long = EngineRequest(rand_ids(6, seed=7), greedy(500), sinks.sink(9))
        engine.submit(requests + [long])
        sinks.wait(lambda ev: all(ended(ev.get(i, [])) for i in range(3)))
        for i, p in enumerate(prompts):
            events = sinks.events[i]
            assert isinstance(events[0], Accepted) and events[0].prompt_token_ids == p
            assert isinstance(events[-1], Finished)
            got = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
            assert got == want[i]
        engine.abort(long)  # mid-generation: its blocks come back, and no more of its events
        deadline = time.monotonic() + DEADLINE_S
        while engine.stats.free_kv_blocks != engine.stats.num_kv_blocks or engine.stats.requests:
            assert time.monotonic() < deadline, engine.stats
            time.sleep(0.01)
        seen = len(sinks.events[9])
        time.sleep(0.2)
        assert len(sinks.events[9]) == seen and not ended(sinks.events[9])
        # A refused request (too long for the cache) is Failed with the engine's ValueError.
        engine.submit([EngineRequest([1, 2], SamplingParams(max_tokens=10**6), sinks.sink(20))])
        sinks.wait(lambda ev: ended(ev.get(20, [])))
        assert isinstance(sinks.events[20][0], Failed) and isinstance(sinks.events[20][0].error, ValueError)
    finally:
        engine.stop()
    assert not engine.running and not engine._proc.is_alive()


def test_a_model_that_cannot_be_built_raises_its_error_here(ckpt):
    engine = EngineProcess(ckpt, {**OPTIONS, "max_num_seqs": 0})
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.start()
    assert not engine.running and not engine._proc.is_alive()
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit([EngineRequest([1, 2], greedy(2), lambda e: None)])


def test_stop_fails_open_requests_and_a_dead_child_fails_them_too(ckpt):
    sinks = Sinks()
    died = []
    engine = EngineProcess(ckpt, OPTIONS)
    engine.on_death = died.append  # (not called: this one is stopped)
    engine.start()
    try:
        engine.submit([EngineRequest(rand_ids(5, seed=1), greedy(500), sinks.sink(0))])
        sinks.wait(lambda ev: any(isinstance(e, Delta) for e in ev.get(0, [])))
    finally:
        engine.stop()
    assert isinstance(sinks.events[0][-1], Failed) and isinstance(sinks.events[0][-1].error, EngineStopped)
    assert not died

    engine = EngineProcess(ckpt, OPTIONS)
    engine.on_death = died.append  # (called: this one dies)
    engine.start()
    try:
        engine.submit([EngineRequest(rand_ids(5, seed=2), greedy(500), sinks.sink(1))])
        sinks.wait(lambda ev: any(isinstance(e, Delta) for e in ev.get(1, [])))
        os.kill(engine._proc.pid, signal.SIGKILL)
        sinks.wait(lambda ev: ended(ev[1]))
        last = sinks.events[1][-1]
        assert isinstance(last, Failed) and "died" in str(last.error)
        deadline = time.monotonic() + DEADLINE_S
        while engine.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "exit code -9" in str(engine.error)
        assert len(died) == 1 and "died" in str(died[0])
        with pytest.raises(RuntimeError, match="not running"):
            engine.submit([EngineRequest([1, 2], greedy(2), lambda e: None)])
    finally:
        engine.stop()


def test_events_of_an_aborted_request_are_dropped_on_both_threads():
    """abort() on the event loop's thread races the reader thread's delivery: events the child
    sent before it heard of the abort are dropped by the reader (the request is gone from the
    registry), and those the reader had already handed on are dropped by call_sinks (the
    request is marked aborted)."""
    from nanovllm.serve.async_engine import call_sinks

    got = []
    engine = EngineProcess("unused", {}, dispatch=call_sinks)
    engine._proc = object()  # (never started: only the registry and the delivery are used)
    engine._send = lambda message: None
    a, b = (EngineRequest([1], greedy(2), lambda e, k=k: got.append((k, e))) for k in "ab")
    engine.submit([a, b])
    in_hand = [(a, Delta(0, "x", [5], None, None, None))]  # taken by the reader before the abort
    engine.abort(a)
    engine._deliver([(a.request_id, Delta(0, "y", [6], None, None, None)), (b.request_id, Finished(0))])
    call_sinks(in_hand)
    assert [k for k, _ in got] == ["b"] and isinstance(got[0][1], Finished)
    assert not engine._requests and a.done and b.done


def test_ctrl_c_while_the_model_loads_ends_the_child(ckpt):
    """The child ignores SIGINT (the parent decides when it stops): a Ctrl-C in start() must
    end it there, or the interpreter's exit would wait for it forever."""
    engine = EngineProcess(ckpt, OPTIONS)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))  # (spawning + importing take longer)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.start()
    finally:
        timer.cancel()
    assert not engine.running and not engine._proc.is_alive()


def test_a_request_whose_preparation_raises_anything_is_refused_not_the_engine(ckpt):
    """A chat template that raises (jinja2's TemplateError: Qwen's templates call
    raise_exception) refuses its request with a ValueError; the engine serves on."""
    from nanovllm.serve.async_engine import ChatPrompt

    sinks = Sinks()
    engine = EngineProcess(ckpt, OPTIONS)
    engine.start()
    try:
        bad = ChatPrompt([{"role": "user", "content": "hi"}], {"chat_template": "{{ raise_exception('boom') }}"})
        engine.submit([EngineRequest(bad, greedy(3), sinks.sink(0))])
        sinks.wait(lambda ev: ended(ev.get(0, [])))
        (failed,) = sinks.events[0]
        assert isinstance(failed, Failed) and isinstance(failed.error, ValueError) and "boom" in str(failed.error)
        engine.submit([EngineRequest(rand_ids(5, seed=3), greedy(3), sinks.sink(1))])
        sinks.wait(lambda ev: ended(ev.get(1, [])))
        assert isinstance(sinks.events[1][-1], Finished) and engine.running
    finally:
        engine.stop()


def test_a_stopped_child_falls_silent_and_speaks_again(ckpt):
    """The child says it is alive every HEARTBEAT_S, from a thread other than the engine loop's:
    only a whole process stopped (SIGSTOP) or frozen falls silent (what /health watches)."""
    from nanovllm.serve.engine_process import HEARTBEAT_S

    engine = EngineProcess(ckpt, OPTIONS)
    engine.start()
    try:
        time.sleep(3 * HEARTBEAT_S)
        assert time.monotonic() - engine.heard_at < 3 * HEARTBEAT_S
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            time.sleep(6 * HEARTBEAT_S)
            assert time.monotonic() - engine.heard_at >= 4 * HEARTBEAT_S
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() - engine.heard_at >= 3 * HEARTBEAT_S:
            assert time.monotonic() < deadline, "no heartbeat after SIGCONT"
            time.sleep(0.05)
        assert engine.running and not engine.stats.busy
    finally:
        engine.stop()


# A chat template that would render for minutes (10^9 loop turns).
SLOW_TEMPLATE = ("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}"
                 "{% endfor %}{% endfor %}hi")


def test_preparer_workers_prepare_as_the_engine_does_and_cut_a_slow_job(ckpt):
    """A PreparerPool's workers give what the engine's own preparation gives (ids, the engine's
    SamplingParams copy, texts) and its errors; a job past the time limit is a PrepareTimeout,
    its worker is killed and replaced, and the pool serves on."""
    import asyncio

    from nanovllm.serve.async_engine import ChatPrompt
    from nanovllm.serve.preparation import PreparerSpec, prepare_requests
    from nanovllm.serve.preparer_pool import PreparerPool, PrepareTimeout

    llm = make_llm(ckpt, **OPTIONS)
    messages = [{"role": "user", "content": "hi"}]
    good = [EngineRequest("Hello there", greedy(4, stop=["x"], bad_words=["ab"]), None, want_prompt_text=True),
            EngineRequest(ChatPrompt(messages), greedy(3), None, fill_max_tokens=True),
            EngineRequest(rand_ids(5, seed=1), None, None, want_prompt_text=True, tokenize_only=True)]
    want = prepare_requests(llm, good)
    pool = PreparerPool(1, timeout=2.0)
    try:
        pool.start(PreparerSpec.of(llm))
        got = asyncio.run(pool.prepare(good))
        assert [vars(g) for g in got] == [vars(w) for w in want]
        assert got[0].params.bad_word_ids == want[0].params.bad_word_ids and got[0].params._frozen
        with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
            asyncio.run(pool.prepare([good[0], EngineRequest([1, 2], SamplingParams(max_tokens=10**6), None)]))
        (first,) = pool.pids
        slow = EngineRequest(ChatPrompt(messages, {"chat_template": SLOW_TEMPLATE}), greedy(2), None)
        t = time.monotonic()
        with pytest.raises(PrepareTimeout):
            asyncio.run(pool.prepare([slow]))
        assert time.monotonic() - t < 2.0 + 10
        got = asyncio.run(asyncio.wait_for(pool.prepare(good), DEADLINE_S))  # (waits for the new worker)
        assert [vars(g) for g in got] == [vars(w) for w in want] and pool.pids and first not in pool.pids
    finally:
        pool.stop()
        llm.shutdown()
