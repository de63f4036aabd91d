"""Data parallelism: N independent engine replicas behind one `LLM`.

`LLM(model, data_parallel_size=N, tensor_parallel_size=T)` builds a `DataParallelLLM`
(nanovllm/llm.py): LLM's own checks, chat template and outputs in the caller's process (so bad
input fails before any work, with the same errors), over this module's `ReplicaSet`, its
executor, which holds the replicas: every call's requests are shared out over them by expected
work (`shard_by_work`), run there, and gathered back in input order. The front's engine holds
no model; its checks read the KV capacity of the smallest replica.

Where the replicas run is a `ReplicaLauncher`'s business (one interface, two implementations):
  local_replicas.py  one process per replica on this node, T GPUs each (CUDA_VISIBLE_DEVICES)
  ray_replicas.py    one Ray actor per replica, in a placement group of T GPUs, anywhere on
                     the Ray cluster the caller connected to
What a replica runs is replica.py: an ordinary LLM of T GPUs, fed validated requests.

Failure: a replica that dies or raises makes the call raise `ReplicaFailed` within seconds,
naming the replica and listing the prompts whose outputs were not returned (with the outputs
that were); the front then shuts every replica down. Nothing is re-run behind the caller's back.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import logging
import random
from dataclasses import dataclass, field

from nanovllm.config import Config
from nanovllm.launch.local_replicas import LocalReplicaLauncher
from nanovllm.launch.ray_replicas import RayCluster, RayReplicaLauncher, front_device
from nanovllm.launch.replica import ReplicaEvent, ReplicaFailed, ReplicaLauncher
from nanovllm.launch.supervisor import PROCESS
from nanovllm.launch.worker import refuse_unguarded_main

logger = logging.getLogger(__name__)

# How often the front looks at the replicas' events while it waits (seconds).
POLL_S = 0.2


def shard_by_work(work: list[int], num_replicas: int) -> list[list[int]]:
    """Indices of `work` per replica, so that every replica gets about the same total: the
    largest items first, each to the replica with the least work so far (the LPT rule: the
    busiest replica ends up with at most 4/3 of the best possible share). Each replica's indices
    come back in input order."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas}: must be >= 1")
    heap = [(0, r) for r in range(num_replicas)]
    shards: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        load, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + work[i], r))
    return [sorted(s) for s in shards]


@dataclass
class ReplicaStats:
    """One replica's share of the last call: prompts, tokens and the seconds its generate took."""

    replica: int
    prompts: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Call:
    """The state of one generate() across the replicas."""

    job: int
    shards: list[list[int]]
    outputs: list = field(default_factory=list)
    pending: set = field(default_factory=set)


class ReplicaSet:
    """The replicas of a data-parallel LLM, and the calls that share work over them.

    Made before the front's Config (with Ray it connects to the cluster first, which decides the
    device), then `start(config)` starts the replicas: it is the front engine's executor factory
    (core/executor.py), and the set its executor, one whose KV capacity (`num_blocks`, the
    smallest replica's) the front's checks read and that runs no steps itself.
    """

    def __init__(self, replica_class, kwargs: dict):
        self.replica_class = replica_class  # what each replica runs (an ordinary LLM of T GPUs)
        self.backend = kwargs.get("distributed_executor_backend") or "mp"
        self.launcher: ReplicaLauncher | None = None
        self._ray_cluster: RayCluster | None = None
        self._closed = False
        self.num_replicas, self.num_blocks, self.info = 0, 0, []
        self.startup_seconds: dict[str, float] = {}  # (each replica's: `info`)
        self.stats: list[ReplicaStats] = []  # of the last generate / chat
        self._jobs, self._request_ids = itertools.count(), itertools.count()
        if self.backend != "ray":
            refuse_unguarded_main()  # the replicas are spawned processes that import the main script
        PROCESS.open_engines.add(self)  # shut down at interpreter exit, before multiprocessing's joins
        replica_device = kwargs.get("device")
        if self.backend == "ray":
            try:
                self._ray_cluster = RayCluster()
                replica_device = self._ray_cluster.replica_device(replica_device)
            except BaseException:
                self.close(abandon=True)
                raise
            kwargs = {**kwargs, "device": front_device(replica_device)}
        self.front_kwargs = kwargs  # the front's own Config: input checks only, no model
        # Each replica is an ordinary single-node engine of T GPUs.
        self.engine_kwargs = {**kwargs, "data_parallel_size": 1, "distributed_executor_backend": None,
                              "device": replica_device}

    def start(self, config: Config) -> "ReplicaSet":
        """Start every replica and wait until each is ready (ReplicaFailed if one is not)."""
        self.num_replicas = config.parallel.data_parallel_size
        if self.backend == "ray":
            self.launcher = RayReplicaLauncher(self._ray_cluster, self.replica_class, config, self.engine_kwargs)
        else:
            self.launcher = LocalReplicaLauncher(self.replica_class, config, self.engine_kwargs)
        info: dict[int, dict] = {}
        while len(info) < self.num_replicas:
            ev = self.launcher.next_event(POLL_S)
            if ev is None:
                continue
            if ev.kind == "ready":
                info[ev.replica] = ev.payload
            elif ev.kind in ("died", "error"):
                raise ReplicaFailed(f"data-parallel replica {ev.replica} ({self.launcher.describe(ev.replica)}) "
                                    f"failed to start: {ev.payload}", ev.replica)
        self.info = [info[r] for r in range(self.num_replicas)]
        self.num_blocks = min(i["num_blocks"] for i in self.info)
        return self

    # ------------------------------------------------------------------ the executor's side
    def launch(self, batch, eos_token_ids=frozenset()):
        raise NotImplementedError("a data-parallel LLM runs no steps in this process (its requests run in "
                                  "the replicas)")

    score = launch

    def release(self, seq) -> None:
        pass  # (no request of the front's own engine ever runs)

    # ------------------------------------------------------------------ calls
    def generate(self, requests: list, rng: random.Random, progress_bar) -> list:
        """The outputs of validated (ids, params, text) requests, in input order. Requests
        without a seed get one from `rng` first: the replicas' own generators all start from
        the same seed, so they would hand their i-th requests the same random stream; this way
        outputs do not depend on the sharding. progress_bar(total) makes the bar (or None)."""
        self._check_open()
        requests = [(ids, p if p.seed is not None else _reseeded(p, rng.getrandbits(63)), text)
                    for ids, p, text in requests]
        work = [len(ids) + p.n * p.max_tokens for ids, p, _ in requests]
        call = _Call(next(self._jobs), shard_by_work(work, self.num_replicas), [None] * len(requests))
        bar = progress_bar(sum(p.n for _, p, _ in requests))
        stats = [ReplicaStats(r) for r in range(self.num_replicas)]
        try:
            for r, shard in enumerate(call.shards):
                if shard:
                    prompts = [_prompt_dict(requests[i][0], requests[i][2]) for i in shard]
                    self.launcher.submit(r, call.job, "generate", (prompts, [requests[i][1] for i in shard]))
                    call.pending.add(r)
            while call.pending:
                self._handle(self.launcher.next_event(POLL_S), call, bar, stats)
        except BaseException as e:
            unfinished = [i for i, o in enumerate(call.outputs) if o is None]
            self.close(abandon=True)  # the survivors are mid-call: nothing would line up again
            if isinstance(e, ReplicaFailed):
                e.unfinished, e.outputs = unfinished, call.outputs
                raise e from None
            raise
        finally:
            if bar is not None:
                bar.close()
        for out in call.outputs:  # unique within this LLM, as a single engine's
            out.request_id = str(next(self._request_ids))
        self.stats = stats
        return call.outputs

    def _handle(self, ev: ReplicaEvent | None, call: _Call, bar, stats: list[ReplicaStats]) -> None:
        """Account for one launcher event of the running call."""
        if ev is None:
            return
        if ev.kind == "died" or (ev.kind == "error" and ev.job == call.job):
            what = "died" if ev.kind == "died" else "raised"
            raise ReplicaFailed(f"data-parallel replica {ev.replica} ({self.launcher.describe(ev.replica)}) {what} "
                                f"during generate(): {ev.payload}\nThe LLM has been shut down; the error's "
                                f"`unfinished` lists the prompts without an output, `outputs` holds the others.",
                                ev.replica)
        if ev.job != call.job:
            return  # a late word from an earlier call
        if ev.kind == "progress" and bar is not None:
            bar.update(ev.payload)
        elif ev.kind == "result":
            value = ev.payload
            shard = call.shards[ev.replica]
            for i, out in zip(shard, value["outputs"]):
                call.outputs[i] = out
            s = stats[ev.replica]
            s.prompts, s.prompt_tokens = len(shard), value["prompt_tokens"]
            s.output_tokens, s.seconds = value["output_tokens"], value["seconds"]
            call.pending.discard(ev.replica)

    def call_all(self, method: str, *args) -> list:
        """`method(*args)` on every replica's Replica; their results in replica order."""
        self._check_open()
        job = next(self._jobs)
        try:
            for r in range(self.num_replicas):
                self.launcher.submit(r, job, method, args)
            results: dict[int, object] = {}
            while len(results) < self.num_replicas:
                ev = self.launcher.next_event(POLL_S)
                if ev is None:
                    continue
                if ev.kind == "died" or (ev.kind == "error" and ev.job == job):
                    raise ReplicaFailed(f"data-parallel replica {ev.replica} ({self.launcher.describe(ev.replica)}) "
                                        f"failed in {method}(): {ev.payload}", ev.replica)
                if ev.kind == "result" and ev.job == job:
                    results[ev.replica] = ev.payload
        except BaseException:
            self.close(abandon=True)
            raise
        return [results[r] for r in range(self.num_replicas)]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down (after a replica failed, shutdown(), or an "
                               "interrupted call)")

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop every replica (processes / actors) and release what they hold; idempotent."""
        self.close(abandon=False)

    def close(self, abandon: bool) -> None:
        """shutdown(); abandon=True: replicas may be mid-call (a failure, Ctrl-C): a moment only."""
        self._closed = True
        PROCESS.open_engines.discard(self)
        if self.launcher is not None:
            self.launcher.shutdown(abandon)
        if self._ray_cluster is not None:
            self._ray_cluster.disconnect()  # stops the cluster if it was started for this LLM


def _prompt_dict(ids: list[int], text: str | None) -> dict:
    """A validated prompt as the replica's LLM takes it: its token ids, and its text if any (so
    RequestOutput.prompt reads the same as on a single engine)."""
    return {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}


def _reseeded(params, seed: int):
    """The engine's validated copy `params` (SamplingParams.snapshot) with `seed` instead: a
    request without a seed gets one of its own, so that no two replicas draw the same random
    stream and the outputs do not depend on how the prompts were shared out."""
    snap = copy.copy(params)
    snap.__dict__["seed"] = seed  # a frozen copy: its fields are set once, here
    return snap
