"""Data parallelism: N independent engine replicas behind one `LLM`.

`LLM(model, data_parallel_size=N, tensor_parallel_size=T)` returns a `DataParallelLLM`
(nanovllm/llm.py), which is this module's `DataParallelFront` mixed into `LLM`: the prompts and
parameters are validated here, in the caller's process, by LLM's own code (so bad input fails
before any work, with the same errors), then every call's requests are shared out over the
replicas by expected work (`shard_by_work`), run there, and gathered back in input order.

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

import heapq
import itertools
import logging
import random
import threading
from dataclasses import dataclass, field

from nanovllm.launch.replica import ReplicaEvent, ReplicaFailed, ReplicaLauncher
from nanovllm.sampling_params import is_integer

logger = logging.getLogger(__name__)

# How often the front looks at the replicas' events while it waits (seconds).
POLL_S = 0.2


def wants_data_parallel(kwargs: dict) -> bool:
    """Whether LLM(**kwargs) needs the data-parallel front: more than one replica, or the Ray
    backend (whose single replica may run on another node). Invalid values are left to Config."""
    dp = kwargs.get("data_parallel_size", 1)
    return kwargs.get("distributed_executor_backend") == "ray" or (is_integer(dp) and dp > 1)


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
class KVCapacity:
    """The KV cache every replica has at least, as LLMEngine.check_fits reads a BlockManager."""

    num_blocks: int
    block_size: int

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)


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


class DataParallelFront:
    """The data-parallel half of `DataParallelLLM` (see the module docstring). Mixed in before
    `LLM`, whose input checks, chat template and output types it reuses; it holds no model and
    no KV cache, only what those checks read (config, tokenizer, vocabulary, KV capacity)."""

    def __init__(self, model: str, **kwargs):
        from nanovllm.config import Config
        from nanovllm.launch.supervisor import PROCESS
        from nanovllm.core.engine import find_eos_token_ids, load_tokenizer, read_generation_defaults

        self._busy = threading.Lock()
        self._token_texts: dict[int, str] = {}
        self._closed = False
        self.launcher = self._ray_cluster = None
        backend = kwargs.get("distributed_executor_backend") or "mp"
        if backend != "ray":
            from nanovllm.launch.worker import refuse_unguarded_main

            refuse_unguarded_main()  # the replicas are spawned processes that import the main script
        PROCESS.open_engines.add(self)  # shut down at interpreter exit, before multiprocessing's joins
        try:
            replica_device = kwargs.get("device")
            if backend == "ray":
                from nanovllm.launch.ray_replicas import RayCluster, front_device

                self._ray_cluster = RayCluster()
                replica_device = self._ray_cluster.replica_device(replica_device)
                kwargs = {**kwargs, "device": front_device(replica_device)}
            self.config = config = Config.from_kwargs(model, **kwargs)
            self.tokenizer = None
            if not config.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode,
                                                config.trust_remote_code, config.revision)
            self.eos_token_ids = frozenset(find_eos_token_ids(config.model, config.hf_config, self.tokenizer))
            gc = config.generation_config
            self.generation_defaults = {} if gc == "vllm" else \
                read_generation_defaults(config.model if gc == "auto" else gc)
            self.vocab_size = config.hf_config.vocab_size
            self.num_replicas = config.data_parallel_size
            self._rng = random.Random(config.seed)  # seeds of the requests that bring none
            self._jobs = itertools.count()
            self._request_ids = itertools.count()
            self.replica_stats: list[ReplicaStats] = []  # of the last generate / chat
            # Each replica is an ordinary single-node engine of T GPUs.
            engine_kwargs = {**kwargs, "data_parallel_size": 1, "distributed_executor_backend": None,
                             "device": replica_device}
            self.launcher = self._make_launcher(backend, config, engine_kwargs)
            self.replica_info = self._wait_ready()
        except BaseException:
            self._close(abandon=True)
            raise
        self.block_manager = KVCapacity(min(i["num_blocks"] for i in self.replica_info), config.kvcache_block_size)

    def _make_launcher(self, backend: str, config, engine_kwargs: dict) -> ReplicaLauncher:
        if backend == "ray":
            from nanovllm.launch.ray_replicas import RayReplicaLauncher

            return RayReplicaLauncher(self._ray_cluster, self.replica_class, config, engine_kwargs)
        from nanovllm.launch.local_replicas import LocalReplicaLauncher

        return LocalReplicaLauncher(self.replica_class, config, engine_kwargs)

    def _wait_ready(self) -> list[dict]:
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
        return [info[r] for r in range(self.num_replicas)]

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, use_tqdm=True) -> list:
        """LLM.generate over the replicas: one RequestOutput per prompt, in input order. The
        prompts are shared out by expected work (prompt tokens + n x max_tokens); one progress
        bar counts the completions of every replica. A replica's failure raises ReplicaFailed
        (see the module docstring)."""
        requests = self._seeded(self._normalize(prompts, sampling_params))
        with self._exclusive():
            return self._run(requests, use_tqdm)

    def _seeded(self, requests: list) -> list:
        """Every request without a seed gets one from the front's generator (seeded by `seed`):
        the replicas' own generators all start from the same seed, so they would hand their
        i-th requests the same random stream; this way outputs do not depend on the sharding."""
        out = []
        for ids, p, text in requests:
            if p.seed is None:
                p = p.reseeded(self._rng.getrandbits(63))
            out.append((ids, p, text))
        return out

    def _run(self, requests: list, use_tqdm) -> list:
        self._check_open()
        work = [len(ids) + p.n * p.max_tokens for ids, p, _ in requests]
        call = _Call(next(self._jobs), shard_by_work(work, self.num_replicas), [None] * len(requests))
        bar = self._progress_bar(use_tqdm, sum(p.n for _, p, _ in requests))  # (LLM's)
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
            self._close(abandon=True)  # the survivors are mid-call: nothing would line up again
            if isinstance(e, ReplicaFailed):
                e.unfinished, e.outputs = unfinished, call.outputs
                raise e from None
            raise
        finally:
            if bar is not None:
                bar.close()
        for out in call.outputs:  # unique within this LLM, as a single engine's
            out.request_id = str(next(self._request_ids))
        self.replica_stats = stats
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

    def _call_all(self, method: str, *args) -> list:
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
            self._close(abandon=True)
            raise
        return [results[r] for r in range(self.num_replicas)]

    def reset_prefix_cache(self) -> bool:
        """Every replica forgets its cached prompt prefixes; False if any had requests running."""
        with self._exclusive():
            return all(self._call_all("reset_prefix_cache"))

    def stream(self, prompts, sampling_params=None):
        raise NotImplementedError("stream() is not available with data parallelism: the increments of several "
                                  "replicas would have to be interleaved; use generate() (or an LLM without "
                                  "data_parallel_size / the Ray backend for streaming)")

    def _engine_only(self, *args, **kwargs):
        raise NotImplementedError("a data-parallel LLM has no engine of its own in this process (its requests run "
                                  "in the replicas): use generate() or chat()")

    add_request = step = abort = has_unfinished = cancel_in_flight = _engine_only

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down (after a replica failed, shutdown(), or an "
                               "interrupted call)")

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stop every replica (processes / actors) and release what they hold; idempotent."""
        self._close(abandon=False)

    def _close(self, abandon: bool) -> None:
        from nanovllm.launch.supervisor import PROCESS

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
