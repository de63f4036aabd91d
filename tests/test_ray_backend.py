"""Data parallelism on Ray (nanovllm/launch/ray_replicas.py), on a local Ray cluster
started by the test (CPU resources only): the same outputs as one engine, a killed actor raises
naming it, no actor is left after shutdown. Skipped where Ray is not installed."""

from __future__ import annotations

import os
import signal
import time

import pytest

import tiny_model as tm
from helpers import greedy, make_llm
from scale_out import ROOT, completions, deadline, gone, mixed_params, prompts

from nanovllm import LLM
from nanovllm.launch.data_parallel import ReplicaFailed

ray = pytest.importorskip("ray")

KW = dict(kvcache_block_size=16, num_kvcache_blocks=64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("ray"), vocab_size=607)


@pytest.fixture
def local_ray(monkeypatch):
    """A Ray cluster of this machine that listens on the loopback only: Ray binds its servers
    to the node's address, which it takes to be the loopback when 'clusters' are off (the
    constant is read by the driver; the environment variable by Ray's own processes)."""
    from ray._private import ray_constants

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    with deadline(60, "starting a local Ray cluster"):
        # The actors must import the nanovllm under test (the package may be installed from
        # another checkout); the driver's process already does.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        yield ray
    finally:
        ray.shutdown()


def alive_actors() -> list:
    from ray._private import state

    return [a for a in state.actors().values() if a["State"] != "DEAD"]


def test_ray_replicas_match_one_engine_and_leave_no_actor(model_path, local_ray):
    with make_llm(model_path, **KW) as one:
        want_greedy = completions(one.generate(prompts(), greedy(8), use_tqdm=False))
        want_mixed = completions(one.generate(prompts(), mixed_params(), use_tqdm=False))
    with deadline(150, "two Ray replicas"):
        llm = LLM(model_path, data_parallel_size=2, distributed_executor_backend="ray", **KW)
        try:
            assert len(alive_actors()) == 2
            info = llm.replica_info
            assert len({i["pid"] for i in info}) == 2 and all(i["cuda_visible_devices"] in (None, "") for i in info)
            assert completions(llm.generate(prompts(), greedy(8), use_tqdm=False)) == want_greedy
            assert completions(llm.generate(prompts(), mixed_params(), use_tqdm=False)) == want_mixed
            assert all(s.prompts > 0 for s in llm.replica_stats)
            # A killed actor: the call raises at once, naming the replica.
            victim = info[1]["pid"]
            os.kill(victim, signal.SIGKILL)
            t = time.monotonic()
            with pytest.raises(ReplicaFailed, match=r"replica 1 \(Ray actor [0-9a-f]+, pid %d" % victim) as e:
                llm.generate(prompts(), greedy(200), use_tqdm=False)
            assert time.monotonic() - t < 30
            assert e.value.unfinished
        finally:
            llm.shutdown()
    end = time.monotonic() + 10
    while alive_actors() and time.monotonic() < end:
        time.sleep(0.2)
    assert not alive_actors()
    assert gone([i["pid"] for i in info])
    assert ray.is_initialized()  # the caller's cluster is the caller's: the LLM leaves it running
