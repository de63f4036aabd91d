"""Data-parallel replicas as Ray actors: the `ReplicaLauncher` of a Ray cluster (many nodes).

Each replica is one actor (`RayReplica`, running replica.Replica) in a placement group of its
own: one bundle of T GPUs (and a CPU) on CUDA, T CPUs without GPUs, so a replica's GPUs are
always on one node and Ray sets its CUDA_VISIBLE_DEVICES; with T > 1 the actor runs the
tensor-parallel workers as its own local processes, as any single-node engine does. The
cluster is the one the caller connected to (`ray.init(address=...)` before creating the LLM),
or a local one that the engine starts for itself (and stops at shutdown).

A call on a replica is a streaming generator task: it yields ("progress", n) as completions
finish and then ("result", value) or ("error", traceback); one thread per running task turns
them into ReplicaEvents. An actor that dies fails its task at once (Ray's ActorDiedError),
which is reported as the replica's death.

Ray is an optional dependency: `pip install "nano-vllm[ray]"`.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
import uuid

from nanovllm.launch.replica import Replica, ReplicaEvent, ReplicaLauncher

logger = logging.getLogger(__name__)

# How long to wait for the cluster to find room for every replica's placement group (an
# autoscaling cluster may have to add nodes first), and for an actor to stop its engine.
PLACEMENT_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


def import_ray():
    """The ray module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'nano-vllm[ray]' "
                          "(or pip install 'ray>=2.9')") from None
    return ray


class RayCluster:
    """This process's connection to Ray: the caller's (ray.init was called before), or a local
    cluster started here and stopped again by `disconnect`."""

    def __init__(self):
        self.ray = import_ray()
        self.owned = not self.ray.is_initialized()
        if self.owned:  # RAY_ADDRESS, when set, points ray.init at an existing cluster
            self.ray.init(include_dashboard=False)

    def replica_device(self, device) -> str:
        """The replicas' device: the one asked for, else CUDA when the cluster has GPUs."""
        if device is not None:
            return str(device)
        return "cuda" if self.ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    def disconnect(self) -> None:
        if self.owned and self.ray.is_initialized():
            self.ray.shutdown()
        self.owned = False


def front_device(replica_device: str) -> str:
    """The device the front's own Config (input checks only, no model) is made for: the driver
    of a Ray job may have no GPU even when the replicas have."""
    import torch

    return "cuda" if replica_device == "cuda" and torch.cuda.is_available() else "cpu"


def replica_bundle(device: str, tp: int) -> dict[str, float]:
    """The resources of one replica: T GPUs and a CPU on CUDA; T CPUs (one per rank) without."""
    return {"GPU": float(tp), "CPU": 1.0} if device == "cuda" else {"CPU": float(tp)}


class RayReplica:
    """The actor of one replica (wrapped by ray.remote in RayReplicaLauncher)."""

    def __init__(self, index: int, engine_class, model: str, engine_kwargs: dict):
        self.replica = Replica(index, engine_class, model, engine_kwargs)

    def info(self) -> dict:
        return self.replica.info()

    def run(self, method: str, args: tuple):
        """`method(*args)` of the Replica, as a generator of ("progress", n) items and a last
        ("result", value) or ("error", traceback). generate runs in a thread of its own, so that
        the progress can be yielded while it runs."""
        if method != "generate":
            try:
                yield "result", getattr(self.replica, method)(*args)
            except Exception:
                yield "error", traceback.format_exc()
            return
        counts: queue.SimpleQueue = queue.SimpleQueue()
        box = {}

        def work():
            try:
                box["result"] = self.replica.generate(*args, progress=counts.put)
            except BaseException:
                box["error"] = traceback.format_exc()
            finally:
                counts.put(None)

        threading.Thread(target=work, daemon=True, name="nanovllm-dp-generate").start()
        while (n := counts.get()) is not None:
            yield "progress", n
        yield ("error", box["error"]) if "error" in box else ("result", box["result"])

    def shutdown(self) -> None:
        self.replica.shutdown()


class RayReplicaLauncher(ReplicaLauncher):
    """Replicas as Ray actors in placement groups (see the module docstring)."""

    def __init__(self, cluster: "RayCluster", engine_class, config, engine_kwargs: dict):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray = cluster.ray
        n, tp = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
        self.num_replicas = n
        self.bundle = replica_bundle(engine_kwargs["device"], tp)
        self.actors, self.groups, self.info = [], [], {}
        self.dead: dict[int, str] = {}
        self._events: queue.Queue[ReplicaEvent] = queue.Queue()
        self._closed = False
        self._check_room(n)
        tag = uuid.uuid4().hex[:8]
        try:
            self.groups = [placement_group([self.bundle], strategy="STRICT_PACK", name=f"nanovllm-dp{r}-{tag}")
                           for r in range(n)]
            ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=n, timeout=PLACEMENT_TIMEOUT_S)
            if len(ready) < n:
                raise RuntimeError(f"the Ray cluster found room for {len(ready)} of {n} replicas of {self.bundle} "
                                   f"within {PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: "
                                   f"{ray.cluster_resources()}, available: {ray.available_resources()})")
            actor_class = ray.remote(RayReplica)
            for r, group in enumerate(self.groups):
                actor = actor_class.options(
                    name=f"nanovllm-dp{r}-{tag}", max_restarts=0, num_cpus=self.bundle["CPU"],
                    num_gpus=self.bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                ).remote(r, engine_class, config.model, engine_kwargs)
                self.actors.append(actor)
                self._follow(r, None, lambda a=actor: iter([a.info.remote()]), kind="ready")
        except BaseException:
            self.shutdown()
            raise

    def _check_room(self, n: int) -> None:
        """A clear error at once when the whole cluster could never hold the replicas."""
        total = self.ray.cluster_resources()
        short = {k: v * n for k, v in self.bundle.items() if total.get(k, 0) < v * n}
        if short:
            raise ValueError(f"{n} data-parallel replica(s) of {self.bundle} need {short} in all, but the Ray cluster "
                             f"has {({k: total.get(k, 0) for k in short})}")

    # ------------------------------------------------------------------ events
    def _follow(self, replica: int, job: int | None, refs, kind: str | None = None) -> None:
        """A thread that waits for the object refs of one task (`refs()` gives them) and reports
        each as an event: `kind` with the value, or the item's own (kind, payload)."""
        def run():
            try:
                for ref in refs():
                    value = self.ray.get(ref)
                    k, payload = (kind, value) if kind is not None else value
                    self._events.put(ReplicaEvent(k, replica, job, payload))
            except Exception as e:
                self._report_failure(replica, job, e)

        threading.Thread(target=run, daemon=True, name=f"nanovllm-dp{replica}-ray").start()

    def _report_failure(self, replica: int, job: int | None, e: Exception) -> None:
        if self._closed:
            return
        from ray.exceptions import RayActorError

        if isinstance(e, RayActorError):
            self._mark_dead(replica, job, f"the actor died: {e}")
        else:
            self._events.put(ReplicaEvent("error", replica, job, f"{type(e).__name__}: {e}"))

    def next_event(self, timeout: float) -> ReplicaEvent | None:
        try:
            ev = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev.kind == "ready":
            self.info[ev.replica] = ev.payload
        return ev

    def describe(self, replica: int) -> str:
        where = "Ray actor"
        if replica < len(self.actors):
            where += f" {self.actors[replica]._actor_id.hex()}"
        info = self.info.get(replica)
        if info is not None:
            where += f", pid {info['pid']} on {info['host']}"
            if info.get("cuda_visible_devices"):
                where += f", GPUs {info['cuda_visible_devices']}"
        return where

    # ------------------------------------------------------------------ calls
    def submit(self, replica: int, job: int, method: str, args: tuple) -> None:
        self._refuse_if_dead(replica)
        actor = self.actors[replica]
        self._follow(replica, job, lambda: actor.run.options(num_returns="streaming").remote(method, args))

    def shutdown(self, abandon: bool = False) -> None:
        """Stop every actor's engine (killing the actors after STOP_TIMEOUT_S; 1 s when
        abandoning a call or after a death) and remove the placement groups."""
        if self._closed:
            return
        self._closed = True
        ray = self.ray
        try:
            if ray.is_initialized():
                stops = [a.shutdown.remote() for r, a in enumerate(self.actors) if r not in self.dead]
                ray.wait(stops, num_returns=len(stops), timeout=1.0 if abandon or self.dead else STOP_TIMEOUT_S)
                for actor in self.actors:
                    ray.kill(actor, no_restart=True)
                for group in self.groups:
                    ray.util.remove_placement_group(group)
        except Exception as e:  # at interpreter exit Ray may have shut down first (its actors with it)
            logger.debug("stopping the Ray replicas: %s", e)
