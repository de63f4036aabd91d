"""Tensor parallelism: the group a model is built for (group.py), its all-reduce algorithms
(fused_all_reduce.py, copy_engine.py), the worker processes (worker.py) supervised from rank 0
(supervisor.py), and the rank-0 runner that drives them all (tensor_parallel.py)."""
