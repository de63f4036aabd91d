"""Tensor parallelism's primitives, which model/ may use: the group a model is built for
(group.py), how a rank creates it (create_group.py), its all-reduce algorithms
(fused_all_reduce.py, copy_engine.py) and the device-side waits they share (device_waits.py).
The processes that run the ranks are launch/'s."""
