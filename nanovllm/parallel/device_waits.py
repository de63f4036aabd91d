"""What a process remembers about the device-side waits of its symmetric-memory all-reduces.

torch keeps symmetric-memory state per process and per group name, so a process remembers the
group names it already rendezvoused (a later engine's group reuses the name and must not
rendezvous again). A kernel that waits on the device for a peer polls an abort word in pinned
host memory; when a peer dies, the launcher (launch/supervisor.py) calls `abort_device_waits`
so that no GPU is left spinning.
"""

from __future__ import annotations

import weakref

import torch

symmetric_memory_groups: set[str] = set()
_waiters: weakref.WeakSet = weakref.WeakSet()


def new_abort_word(owner) -> torch.Tensor:
    """A zeroed int32 in pinned host memory that `owner`'s device-side waits poll (read in place
    through unified addressing); `abort_device_waits` sets it. `owner` keeps it as `abort_word`."""
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    _waiters.add(owner)
    return word


def abort_device_waits() -> None:
    """Make every device-side wait for a peer in this process give up, for good (a peer died):
    the waiting kernels then finish with meaningless sums, and the engine must be closed."""
    for waiter in list(_waiters):
        waiter.abort_word[0] = 1
