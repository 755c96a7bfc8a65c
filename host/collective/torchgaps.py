"""What torch.distributed keeps but does not expose.

A process group's timeout is set when it is made and kept on its backend's options only;
torch has no public way to read it back. The DDP hooks make a group of their own beside the
one they are given, which must wait as long: without the value it would wait torch's default
(30 minutes). :func:`group_timeout` reads it and says so where it cannot.
"""
from __future__ import annotations

import warnings


def group_timeout(group, quiet: bool = False):
    """The timeout ``group`` (None: the default group) was made with, or None (with a
    warning, unless ``quiet``) where this torch keeps it elsewhere."""
    import torch.distributed as dist
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(next(iter(pg._device_types))).options._timeout
    except (AttributeError, RuntimeError, StopIteration) as e:
        if quiet:
            return None
        warnings.warn(f"cannot read the process group's timeout from this torch ({e!r}): the "
                      f"hook's own group gets torch's default; pass comm_group= a group made "
                      f"with the timeout wanted", RuntimeWarning, stacklevel=3)
        return None
