"""Process-group helpers: a single process without torch.distributed is a world of one.

`group=None` means what it means in torch.distributed: the default group (every rank), or, when
torch.distributed is not initialised, this process alone. The attention library, the trainer and
evaluation all use this one meaning.
"""

from __future__ import annotations

import torch.distributed as dist


def group_rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world_size) inside `group` (None: the default group); (0, 1) when torch.distributed is
    not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised; "
                             "call torch.distributed.init_process_group first or pass group=None")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (what point-to-point calls address)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
