"""The data-parallel front: `DataParallelLLM`, what `LLM(model, data_parallel_size=N, ...)` (or
distributed_executor_backend="ray") makes, is this module's DataParallelFront mixed into `LLM`
(data_parallel_llm; llm.py asks for it through nanovllm/wiring/, so a plain LLM loads none of it).

It keeps LLM's checks, chat template and outputs, in the caller's process, and sends each
call's requests to N engine replicas: launch/data_parallel.py's `ReplicaSet`, which is this
LLM's executor. So the LLM's engine here holds no model; it checks requests against the KV
cache of the smallest replica, and refuses the calls that would need an engine of its own.
"""

from __future__ import annotations

import functools

from nanovllm.launch.data_parallel import ReplicaSet
from nanovllm.llm_calls import progress_bar
from nanovllm.outputs import RequestOutput


class DataParallelFront:
    """The methods of DataParallelLLM that differ from LLM's (mixed in before it, see the module
    docstring); `replica_class`: what each replica runs."""

    replica_class: type

    def __init__(self, model: str, **kwargs):
        self.replicas = ReplicaSet(self.replica_class, kwargs)
        try:
            super().__init__(model, **self.replicas.front_kwargs)
        except BaseException:
            self.replicas.close(abandon=True)
            raise

    def _start_executor(self, config):
        return self.replicas.start(config)

    @property
    def replica_info(self) -> list[dict]:
        return self.replicas.info

    @property
    def replica_stats(self) -> list:
        """Each replica's share of the last generate / chat (launch/data_parallel.ReplicaStats)."""
        return self.replicas.stats

    def _run_requests(self, requests, use_tqdm, adapters=None) -> list[RequestOutput]:
        """generate / chat over the replicas: one RequestOutput per prompt, in input order, shared
        out by expected work; one progress bar counts every replica's completions. A replica's
        failure raises ReplicaFailed (see launch/data_parallel.py). (`adapters`: always None,
        since enable_lora does not go with data parallelism yet: Config refuses it.)"""
        with self._exclusive():
            return self.replicas.generate(requests, self._rng, lambda total: progress_bar(use_tqdm, total))

    def reset_prefix_cache(self) -> bool:
        """Every replica forgets its cached prompt prefixes; False if any had requests running."""
        with self._exclusive():
            return all(self.replicas.call_all("reset_prefix_cache"))

    def stream(self, prompts, sampling_params=None, lora_request=None):
        raise NotImplementedError("stream() is not available with data parallelism: the increments of several "
                                  "replicas would have to be interleaved; use generate() (or an LLM without "
                                  "data_parallel_size / the Ray backend for streaming)")

    def get_metrics(self):
        raise NotImplementedError("get_metrics() is not available with data parallelism: each replica keeps its "
                                  "own statistics")

    def _engine_only(self, *args, **kwargs):
        raise NotImplementedError("a data-parallel LLM has no engine of its own in this process (its requests run "
                                  "in the replicas): use generate() or chat()")

    add_request = step = abort = has_unfinished = cancel_in_flight = _engine_only


@functools.cache
def data_parallel_llm(llm_class: type) -> type:
    """DataParallelLLM: the front mixed into `llm_class` (LLM), made once: LLM's checks, chat
    template and outputs here, each call's requests run by N replicas of `llm_class`."""

    class DataParallelLLM(DataParallelFront, llm_class):
        __doc__ = data_parallel_llm.__doc__
        replica_class = llm_class  # what each replica runs (an ordinary engine of tensor_parallel_size GPUs)

    DataParallelLLM.__module__ = __name__
    return DataParallelLLM
