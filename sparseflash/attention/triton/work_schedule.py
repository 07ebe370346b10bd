"""Work schedules of the persistent Gluon forward: which work items each program takes.

A work item is one tile the kernel computes from start to end (a query tile of a (batch, head)); where items
differ in length (CAUSAL, SPARSE masks whose rows of blocks differ), a program per multiprocessor takes the items a
table made on the host lists for it (``greedy_schedule``), and loads each next item's tiles under the current
item's products, where a program launched for each item waited for them. Elsewhere a program takes items pid,
pid + num_programs, ... (The Gluon backward keeps a program per key tile: the same schedule over its key tiles ran
hd64 causal 0.94-0.98x as fast, docs/kernels.md, "The Gluon backward".)

The table (int32 on the device): STARTS, programs + 1 entries, then the items' codes program after program
(line * tiles of a line + tile): program p takes entries STARTS[p] to STARTS[p + 1].
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sparseflash.attention.kept_tensors import made_outside_graph_pools

# SPARSE masks whose longest line (row) of blocks has over this many times the mean: their items are scheduled
UNEQUAL_LINES = 1.25


@gluon.jit
def program_items(SCHEDULE, n_items, num_programs, SCHEDULED: gl.constexpr):
    """(first, end, step) of the program's loop over its entries: SCHEDULE's entries SCHEDULE[pid] to
    SCHEDULE[pid + 1], or items pid, pid + num_programs, ... of the n_items."""
    pid = gl.program_id(0)
    if SCHEDULED:
        return gl.load(SCHEDULE + pid), gl.load(SCHEDULE + pid + 1), 1
    else:
        return pid, n_items, num_programs


@gluon.jit
def scheduled_item(SCHEDULE, entry, SCHEDULED: gl.constexpr):
    """The code of the item at ``entry`` of a loop from ``program_items``."""
    if SCHEDULED:
        return gl.load(SCHEDULE + entry)
    else:
        return entry


def greedy_schedule(tiles: torch.Tensor, programs: int, item_cost: float, device: torch.device) -> torch.Tensor:
    """The table of ``programs`` programs for the items of ``tiles`` ((lines, tiles of a line): the tiles each item
    walks; item code line * tiles.shape[1] + tile): the items of each line in turn, the longest first, each to the
    program whose items so far cost least (a heap of them), an item costing its tiles (at least one) and
    ``item_cost``. This is the order in which the GPU hands out items to programs as programs end; a program's
    loads of its next item overlap the current one's products. Greedy list scheduling leaves no program more
    than the longest item's cost past the mean."""
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    items = (order + torch.arange(tiles.shape[0])[:, None] * tiles.shape[1]).flatten().tolist()
    costs = (torch.gather(tiles, 1, order).clamp(min=1) + item_cost).flatten().tolist()
    loads = [(0, p) for p in range(programs)]
    taken = [[] for _ in range(programs)]
    for item, cost in zip(items, costs):
        load, p = loads[0]
        taken[p].append(item)
        heapq.heapreplace(loads, (load + cost, p))
    starts = itertools.accumulate((len(chosen) for chosen in taken), initial=programs + 1)
    return torch.tensor([*starts, *itertools.chain.from_iterable(taken)], dtype=torch.int32, device=device)


def kept_schedule(plan, name: str, programs: int, item_tiles: Callable[[], torch.Tensor | None],
                  item_cost: float) -> torch.Tensor | None:
    """The ``greedy_schedule`` of ``item_tiles()`` for ``programs`` programs, or None where that is None (items of
    equal lengths): made once and kept in the plan's ``per_layout[name]`` by programs (made outside CUDA graph
    pools, ``kept_tensors``) and among its ``tensors`` (``LaunchPlan.hold``: replays launch with it)."""
    kept = plan.per_layout.setdefault(name, {})
    if programs not in kept:
        def made() -> torch.Tensor | None:
            tiles = item_tiles()
            return None if tiles is None else plan.hold(greedy_schedule(tiles, programs, item_cost,
                                                                        plan.placeholder.device))

        kept[programs] = made_outside_graph_pools(made, plan.placeholder.device)
    return kept[programs]
