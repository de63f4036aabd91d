"""Data parallelism with local replica processes (nanovllm/launch/data_parallel.py,
local_replicas.py, replica.py), on CPU: the same outputs as one engine, in input order; a
killed replica raises quickly, naming it; nothing is left running after shutdown.

Every multi-process test runs under a deadline; each engine is small (tiny checkpoint)."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

import tiny_model as tm
from helpers import greedy, make_llm
from scale_out import completions, deadline, gone, mixed_params, no_children, prompts

from nanovllm import LLM, SamplingParams
from nanovllm.config import wants_data_parallel
from nanovllm.core.engine import LLMEngine
from nanovllm.launch.data_parallel import ReplicaFailed, shard_by_work

KW = dict(kvcache_block_size=16, num_kvcache_blocks=64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # Odd vocabulary: the vocab-parallel LM head pads its shards under DP x TP.
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("dp"), vocab_size=607)


@pytest.fixture(autouse=True)
def loopback_gloo(monkeypatch):
    # Tensor-parallel replicas rendezvous through gloo: keep its sockets on the loopback.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="module")
def reference(model_path):
    """One engine's outputs for the shared prompts (greedy, and the mixed parameters)."""
    with make_llm(model_path, **KW) as llm:
        return {"greedy": completions(llm.generate(prompts(), greedy(8), use_tqdm=False)),
                "mixed": llm.generate(prompts(), mixed_params(), use_tqdm=False),
                "chat": llm.chat([{"role": "user", "content": "hello there"}], SamplingParams(max_tokens=6, seed=4),
                                 use_tqdm=False)[0].outputs[0].text}


def test_shard_by_work_balances_and_keeps_every_index_once(fresh_seed):
    rng = random.Random(fresh_seed)
    for _ in range(50):
        work = [rng.randint(1, 1000) for _ in range(rng.randint(0, 40))]
        n = rng.randint(1, 6)
        shards = shard_by_work(work, n)
        assert len(shards) == n
        assert sorted(i for s in shards for i in s) == list(range(len(work)))
        assert all(s == sorted(s) for s in shards)
        loads = [sum(work[i] for i in s) for s in shards]
        # Greedy on the largest-first order: the busiest replica is at most the average plus one item.
        assert max(loads, default=0) <= sum(work) / n + max(work, default=0)
    assert shard_by_work([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="num_replicas"):
        shard_by_work([1], 0)


def test_front_is_picked_by_the_options_and_validated_before_any_process(model_path):
    assert not wants_data_parallel({}) and not wants_data_parallel({"data_parallel_size": 1})
    assert wants_data_parallel({"data_parallel_size": 2})
    assert wants_data_parallel({"distributed_executor_backend": "ray"})
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        LLM(model_path, data_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(model_path, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="external_launcher"):
        LLM(model_path, data_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(TypeError, match="bogus"):
        LLM(model_path, data_parallel_size=2, bogus=1)
    with pytest.raises(ValueError, match="LLM"):
        LLMEngine(model_path, data_parallel_size=2, **KW)
    assert no_children(0)


def test_dp2_matches_one_engine_in_input_order(model_path, reference):
    bars = []

    class Bar:  # use_tqdm as a callable (vLLM's form): one bar over every replica
        def __init__(self, total, **kw):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    with deadline(120, "DP=2 on CPU"), LLM(model_path, data_parallel_size=2, **KW) as llm:
        assert type(llm).__name__ == "DataParallelLLM" and isinstance(llm, LLM)
        assert len({i["pid"] for i in llm.replica_info}) == 2
        assert completions(llm.generate(prompts(), greedy(8), use_tqdm=False)) == reference["greedy"]
        outs = llm.generate(prompts(), mixed_params(), use_tqdm=Bar)
        # Seeded sampling (n > 1 too), filters, penalties and logprobs: the replica does not matter.
        assert completions(outs) == completions(reference["mixed"])
        for got, want in zip(outs, reference["mixed"]):
            assert got.prompt_token_ids == want.prompt_token_ids and got["token_ids"] == want["token_ids"]
            assert [c.index for c in got.outputs] == [c.index for c in want.outputs]
            assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
            for c, w in zip(got.outputs, want.outputs):
                assert (c.logprobs is None) == (w.logprobs is None)
                if c.logprobs is not None:
                    assert [list(d) for d in c.logprobs] == [list(d) for d in w.logprobs]
                    assert c.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
        total = sum(p.n for p in mixed_params())
        assert len(bars) == 1 and bars[0].total == total and bars[0].n == total
        assert len({o.request_id for o in outs}) == len(outs)  # unique across replicas
        stats = llm.replica_stats
        assert [s.replica for s in stats] == [0, 1] and all(s.prompts > 0 for s in stats)
        assert sum(s.output_tokens for s in stats) == sum(len(t) for o in outs for t in completions([o])[0])
        assert llm.chat([{"role": "user", "content": "hello there"}], SamplingParams(max_tokens=6, seed=4),
                        use_tqdm=False)[0].outputs[0].text == reference["chat"]
        # Bad input: a clear error before any work, and the LLM stays usable.
        with pytest.raises(ValueError, match="prompt 1: token id 9999"):
            llm.generate([[1, 2], [9999]], greedy(2))
        with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
            llm.generate([[1, 2], [3]], [greedy(2)])
        with pytest.raises(NotImplementedError, match="stream"):
            llm.stream([[1, 2]], greedy(2))
        with pytest.raises(NotImplementedError, match="generate"):
            llm.step()
        assert llm.reset_prefix_cache() is True
        assert completions(llm.generate(prompts()[:1], greedy(8), use_tqdm=False)) == reference["greedy"][:1]
        # Requests without a seed get distinct streams, wherever they run.
        same = llm.generate([[3, 4, 5]] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        assert len({tuple(o["token_ids"]) for o in same}) > 1
    assert no_children()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], greedy(2))


def test_dp2_by_tp2_on_gloo_matches_one_engine(model_path, reference):
    with deadline(180, "DP=2 x TP=2 on CPU"), \
            LLM(model_path, data_parallel_size=2, tensor_parallel_size=2, **KW) as llm:
        workers = [pid for i in llm.replica_info for pid in i["worker_pids"]]
        assert len(workers) == 2  # one tensor-parallel worker per replica
        assert completions(llm.generate(prompts(), greedy(8), use_tqdm=False)) == reference["greedy"]
        assert completions(llm.generate(prompts(), mixed_params(), use_tqdm=False)) == \
            completions(reference["mixed"])
        replicas = [i["pid"] for i in llm.replica_info]
    assert no_children()
    assert gone(workers + replicas)


def test_killed_replica_raises_quickly_naming_it_and_lists_unfinished_prompts(model_path):
    llm = LLM(model_path, data_parallel_size=2, **KW)
    try:
        victim = llm.replica_info[1]["pid"]
        killed = {}

        class KillAtFirstCompletion:
            """The progress bar: the first completion (a short request) means the call is under way
            while the long ones still run (400 tokens), whatever the machine's speed: kill then."""

            def __init__(self, **_):
                pass

            def update(self, n):
                if "at" not in killed:
                    killed["at"] = time.monotonic()
                    os.kill(victim, signal.SIGKILL)

            def close(self):
                pass

        params = [greedy(2 if i % 2 else 400) for i in range(12)]
        with deadline(60, "a generate with a killed replica"):
            with pytest.raises(ReplicaFailed) as info:
                llm.generate([[i + 1] * (i + 2) for i in range(12)], params, use_tqdm=KillAtFirstCompletion)
        raised = time.monotonic() - killed["at"]
        assert raised < 30, f"raised {raised:.1f} s after the kill"
        e = info.value
        assert e.replica == 1
        assert f"replica 1 (pid {victim})" in str(e) and "SIGKILL" in str(e)
        assert e.unfinished and all(e.outputs[i] is None for i in e.unfinished)
        assert len(e.outputs) == 12 and all(o is not None for i, o in enumerate(e.outputs) if i not in e.unfinished)
        assert no_children()  # the survivor was shut down too
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate([[1, 2]], greedy(2))
    finally:
        llm.shutdown()
    assert no_children()


def test_replica_dead_between_calls_fails_the_next_call(model_path):
    with deadline(60, "DP=2 with a replica killed while idle"):
        llm = LLM(model_path, data_parallel_size=2, **KW)
        try:
            victim = llm.replica_info[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            assert gone([victim])
            t = time.monotonic()
            with pytest.raises(ReplicaFailed, match=f"replica 0 \\(pid {victim}\\)") as info:
                llm.generate(prompts(), greedy(4), use_tqdm=False)
            assert time.monotonic() - t < 10
            # The dead replica's prompts have no output; the live one may have finished its shard
            # before the death was seen (how far it got depends on the machine's speed).
            unfinished, outputs = info.value.unfinished, info.value.outputs
            assert unfinished and sorted(unfinished) == [i for i, o in enumerate(outputs) if o is None]
            assert all(len(o.outputs[0].token_ids) == 4 for o in outputs if o is not None)
        finally:
            llm.shutdown()
    assert no_children()


UNGUARDED = """
import sys
from nanovllm import LLM
LLM(sys.argv[1], data_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64)
"""


def test_script_without_a_main_guard_gets_an_error_naming_it(model_path, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.run([sys.executable, str(script), model_path], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode != 0
    assert "__main__" in proc.stderr and re.search(r"replica [01] \(pid \d+\)", proc.stderr), proc.stderr[-3000:]


def test_bench_dp2_reports_per_replica_throughput(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import bench
    path = tm.make_tiny_qwen3(tmp_path / "ckpt", vocab_size=10_001)  # the workload's ids go up to 10000
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "bench.py"), "--model", path, "--dp", "2",
                           "--num-seqs", "4", "--max-input-len", "110", "--max-output-len", "102",
                           "--block-size", "16", "--json", str(out), "--bandwidth", str(bench.H200_COPY_BANDWIDTH)],
                          capture_output=True, text=True, timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    _, max_tokens = bench.workload(4, 110, 102)
    assert res["dp"] == 2 and res["output_tokens"] == sum(max_tokens)
    reps = res["replicas"]
    assert [r["replica"] for r in reps] == [0, 1] and sum(r["prompts"] for r in reps) == 4
    assert sum(r["output_tokens"] for r in reps) == sum(max_tokens)
    assert all(r["output_tok_s"] > 0 and r["seconds"] > 0 for r in reps)
    assert 0 <= res["fraction_of_floor"] <= 1


ENDS_WITHOUT_SHUTDOWN = """
import sys, time
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], data_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64)
    llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    print("PIDS", *[i["pid"] for i in llm.replica_info], flush=True)
    if sys.argv[2] == "wait":
        time.sleep(120)  # killed by the test
"""


def start_script(model_path, tmp_path, mode):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(ENDS_WITHOUT_SHUTDOWN)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, str(script), model_path, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root})


def read_pids(proc) -> list[int]:
    for _ in range(50):  # bounded: the script prints a few lines at most
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("PIDS"):
            return [int(p) for p in line.split()[1:]]
    raise AssertionError(f"no PIDS line; stderr: {proc.stderr.read()[-3000:]}")


def test_script_ending_without_shutdown_stops_its_replicas(model_path, tmp_path):
    proc = start_script(model_path, tmp_path, "exit")
    try:
        with deadline(90, "a script with a DP=2 LLM"):
            pids = read_pids(proc)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert len(pids) == 2 and gone(pids)


def test_replicas_exit_when_the_front_process_is_killed(model_path, tmp_path):
    proc = start_script(model_path, tmp_path, "wait")
    try:
        with deadline(90, "a script with a DP=2 LLM"):
            pids = read_pids(proc)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert len(pids) == 2 and gone(pids, timeout=15)
