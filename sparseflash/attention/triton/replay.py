"""Calls launched again without the Python that chose their launches.

A forward or backward call goes through the layers that decide what to launch (the plan's tables and flags, the
tuned config, the stand-ins of a first call, the Gluon or the Triton kernels) and through ``Launcher``, which looks
up the compiled kernel: on a GPU host that took ~0.1 ms of a forward's host time and ~0.2 ms of a backward's, more
than their kernels take at short rows (docs/kernels.md, "Host time and the Launcher"). A call that settled (it tuned
and stood in for nothing, and no choice changed meanwhile; a launch that compiled its kernel counts) is kept as a
``Replay``: its launches, each tensor argument named by its slot among the call's tensors (its inputs and the
outputs it allocates) or taken as a tensor of the plan (its tables, its placeholder), which every call shares. A
later call with the same plan and layout key then launches the same kernels with the same grids and scalars on its
own tensors; a TMA descriptor (the Gluon kernels') over one of those tensors is kept without it (a replay holds no
tensor of the call it kept) and rebuilt over the later call's (its shape, strides and box are the layout's). A call
that launched with any other tensor (a copy made on the call) or did more than launch kernels is not kept; the
caller sees to the second (``keep``'s ``settled``).

A replay called again on tensors at the same addresses (a training loop's steps, whose allocations repeat) launches
them as one CUDA graph, captured on the second call of those addresses: one graph launch in place of the Python
that built each launch's arguments and of Triton's launcher (the Gluon kernels' TMA descriptors encoded on every
launch); ``SPARSEFLASH_GRAPH_REPLAYS=0`` turns that off. A call's last few slots may be *copied*: small tensors a
call allocates anew (its key lengths in int32, its dropout seed), whose addresses a loop does not repeat (a model's
layers keep them for their backwards while other small tensors come and go around them): the graphs read them from
buffers of the replay's, into which each graph launch first copies the call's, so that they do not enter a graph's
key. The buffers are made with the replay, in a pool of their own (``made_outside_graph_pools``): made at a graph's
capture, in the pool of the calls' stream, they would move the small tensors the next calls allocate, whose graph
then is not the one captured.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import os
import threading
import warnings
from collections import OrderedDict
from typing import Iterator

import torch

from sparseflash.attention.kept_tensors import made_outside_graph_pools
from sparseflash.attention.triton import tuning
from sparseflash.attention.triton.launch import current_device, current_stream, launch_hooks_set, recorded

# kept for a layout whose calls launch what a replay cannot take (a copy made on the call, a tensor of neither the
# call nor the plan, a launch through Triton's interpreter)
NOT_REPLAYED = False
# CUDA graphs a replay keeps, one per tuple of its slots' addresses, the least recently launched dropped first: the
# layers of a model that share a plan (up to this many) each call it on tensors of their own. A graph of a few kernel
# launches holds none of the calls' memory (the replay allocates nothing inside its capture), a few KB of the driver's.
GRAPHS_KEPT = 256
SEEN_KEPT = 4 * GRAPHS_KEPT  # address tuples remembered from one call (the second call of one captures its graph)


class Replay:
    """The launches of one call, to launch again on the tensors of a later call: ``replay(slots)``."""

    def __init__(self, steps: list[tuple], constants: list[torch.Tensor], outcome=True, placed: int | None = None,
                 copied: tuple[tuple[int, torch.Tensor], ...] = ()):
        # (Compiled, 3-D grid, indices into the slots' addresses and the constants', scalars, and (places, index,
        # descriptor) of each TMA descriptor among the arguments, at one or more places: rebuilt over the tensor at
        # that index)
        self._steps = steps
        self._constants = constants  # (kept alive: their addresses are in the steps)
        self._constant_addresses = [t.data_ptr() for t in constants]
        self._device = current_device()  # the device the kernels were loaded on
        self.outcome = outcome  # what the kept call reported (``Replays.keep``'s settled): the backward it ran
        # a graph's key: the addresses of the slots before ``placed`` (all: None); (slot, buffer) of each slot the
        # graphs read from a copy (on one stream, a launch's copies are made after the previous launch read them)
        self._placed, self._copied = placed, copied
        self._graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()  # by their keys
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._captures = self._graph_hits = 0  # graphs captured; calls that launched a graph captured before
        # not where a kernel takes global scratch: Triton's allocator would allocate it inside the capture
        self._graphed = os.environ.get("SPARSEFLASH_GRAPH_REPLAYS", "1") != "0" and all(
            step[0].scratch is None for step in steps)

    @classmethod
    def of(cls, launches: list, slots: tuple[torch.Tensor, ...], constants: tuple[torch.Tensor, ...], outcome=True,
           copied: int = 0):
        """The replay of ``launches`` (a ``recorded`` block's) on calls that give their tensors as ``slots`` (this
        call's, in the order later calls will give theirs), ``constants`` the plan's tensors, ``outcome`` what the
        call reported (``Replay.outcome``), the last ``copied`` slots read by its graphs from copies; None where
        this call cannot be kept but a later one may be (one tensor in two slots, a misaligned slot); NOT_REPLAYED
        where no call of this layout can be (a launch with another tensor, or through Triton's interpreter)."""
        if not launches or None in launches:
            return NOT_REPLAYED
        index = {id(t): len(slots) + i for i, t in enumerate(constants)}
        for i, t in enumerate(slots):
            if id(t) in index and index[id(t)] >= len(slots):
                continue  # a plan's tensor in a slot (the placeholder of absent key lengths): a constant
            if id(t) in index or t.data_ptr() % 16:
                return None  # (q is k on this call, not on all; a kernel specialised on a misaligned tensor)
            index[id(t)] = i
        steps = []
        for compiled, grid, tensors, scalars in launches:
            bases = [getattr(t, "base", t) for t in tensors]  # (a TMA descriptor's base: the tensor it reads)
            if any(id(t) not in index for t in bases):
                return NOT_REPLAYED
            indices = [index[id(t)] for t in bases]
            places: dict[int, list[int]] = {}  # a descriptor's places among the arguments (one object: one copy)
            for i, t in enumerate(tensors):
                if t is not bases[i]:
                    places.setdefault(id(t), []).append(i)
            descriptors = [(at, indices[at[0]], _rebased(tensors[at[0]], None)) for at in places.values()]
            steps.append((compiled, (*grid, 1, 1)[:3], indices, scalars, descriptors))
        placed = len(slots) - copied
        # (a copied slot that holds a plan's tensor, the placeholder of absent key lengths, is a constant)
        copies = [i for i in range(placed, len(slots)) if index[id(slots[i])] == i]
        if not copies:
            return cls(steps, list(constants), outcome, placed)
        if torch.cuda.is_current_stream_capturing():
            return None  # (a caller's capture, torch.compile's reduce-overhead: its buffers cannot be made there)
        buffers = made_outside_graph_pools(lambda: [torch.empty_like(slots[i]) for i in copies], slots[0].device)
        return cls(steps, list(constants), outcome, placed, tuple(zip(copies, buffers)))

    def __call__(self, slots: tuple[torch.Tensor, ...]) -> bool:
        """Launch the kept launches on ``slots``: True; False (nothing launched) where a slot is not 16-byte
        aligned, another device is the current one, or Triton's launch hooks are set (a profiler's: a launch
        through Triton calls them)."""
        addresses = tuple(t.data_ptr() for t in slots)
        device = current_device()
        if functools.reduce(operator.or_, addresses) % 16 or device != self._device or launch_hooks_set():
            return False
        graph = self._graph(addresses, slots) if self._graphed else None
        if graph is not None:
            for i, buffer in self._copied:  # (on the stream the graph then runs on: done before it reads them)
                buffer.copy_(slots[i])
            graph.replay()
        else:
            self._launch(addresses, slots, current_stream(device))
        return True

    def _launch(self, addresses: tuple, slots: tuple, stream: int) -> None:
        addresses = (*addresses, *self._constant_addresses)
        for compiled, grid, indices, scalars, descriptors in self._steps:
            arguments = [addresses[i] for i in indices]
            for places, i, descriptor in descriptors:
                rebased = _rebased(descriptor, slots[i] if i < len(slots) else self._constants[i - len(slots)])
                for place in places:
                    arguments[place] = rebased
            compiled.launch(grid, stream, arguments, scalars)

    def _graph(self, addresses: tuple, slots: tuple) -> torch.cuda.CUDAGraph | None:
        """The CUDA graph of the launches on tensors at ``addresses`` (the copied slots' aside: read from the
        buffers): kept, or captured now where a call with the same key was seen before; None where the launches are
        to be made one by one (a first call with this key, a caller's capture in progress, which records them, or a
        replay that stopped capturing)."""
        key = addresses[:self._placed]
        with _GRAPHS_LOCK:  # (two threads' calls: one capture at a time on the side stream, and whole bookkeeping)
            graph = self._graphs.get(key)
            if graph is None and key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > SEEN_KEPT:
                    self._seen.popitem(last=False)
                return None
            if torch.cuda.is_current_stream_capturing():
                return None
            if graph is not None:
                self._graphs.move_to_end(key)
                self._graph_hits += 1
                return graph
            if self._captures >= 2 * GRAPHS_KEPT and self._graph_hits < self._captures:
                self._graphed = False  # more address tuples recur than it keeps graphs of: captures are not repaid
                return None
            read, at = list(slots), list(addresses)
            for i, buffer in self._copied:
                read[i], at[i] = buffer, buffer.data_ptr()
            try:
                graph = _captured(lambda stream: self._launch(tuple(at), tuple(read), stream), self._device)
            except RuntimeError as error:
                self._graphed = False  # one by one from now on (a launch's own error then reaches the caller)
                warnings.warn(f"sparseflash: capturing a replay's kernels as a CUDA graph failed ({error}); its "
                              "calls launch them one by one", RuntimeWarning, stacklevel=2)
                return None
            self._captures += 1
            del self._seen[key]
            self._graphs[key] = graph
            if len(self._graphs) > GRAPHS_KEPT:
                self._graphs.popitem(last=False)
            return graph


_GRAPHS_LOCK = threading.Lock()


def _captured(launch, device: int) -> torch.cuda.CUDAGraph:
    """The CUDA graph of what ``launch(stream)`` launches on ``stream``, captured on a side stream of ``device`` (a
    capture cannot take the legacy default stream), launching nothing."""
    graph, side, pool = torch.cuda.CUDAGraph(), _capture_stream(device), torch.cuda.graph_pool_handle()
    with torch.cuda.stream(side):
        try:
            # (thread_local: another thread's CUDA calls meanwhile, as the caller's while autograd's device thread
            # runs a backward, do not invalidate the capture)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                launch(side.cuda_stream)
            finally:
                graph.capture_end()
        except RuntimeError:
            # torch's capture_begin has the allocator route the capture's allocations to the pool before the capture
            # starts, and capture_end ends that only after a capture that ended: a failed one would leave the
            # allocator believing a capture is under way (empty_cache refuses, out-of-memory frees no cached block)
            with contextlib.suppress(RuntimeError, AttributeError):  # (ended already: torch says so)
                torch._C._cuda_endAllocateToPool(device, pool)
            raise
    return graph


@functools.lru_cache(maxsize=None)
def _capture_stream(device: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _rebased(descriptor, base: torch.Tensor | None):
    """A copy of the TMA descriptor ``descriptor`` (Gluon's TensorDescriptor) over ``base``, a tensor of its base's
    layout (None: over nothing, as a replay keeps it): not checked again (its checks, run when it was made, cost more
    than the launch)."""
    rebased = copy.copy(descriptor)
    rebased.base = base
    return rebased


class Replays:
    """A plan's replays of one kind of call (forward or backward), by layout key: ``replays.get(key)`` is the
    replay to launch, if kept under the current tuning choices; ``with replays.keep(key, slots, constants) as
    settled:`` records the launches of the block and keeps them where the block sets ``settled[0]`` (to a true
    value, which the replay keeps as its ``outcome``); ``constants`` (the plan's ``tensors``) is read after the
    block, which may add to it; ``copied``: ``Replay.of``'s."""

    def __init__(self):
        self._kept: dict[tuple, tuple[int, Replay | bool]] = {}

    def get(self, key: tuple) -> Replay | None:
        version, replay = self._kept.get(key, (None, None))
        current = tuning.choices_version()
        return replay if replay and current is not None and version == current else None

    @contextlib.contextmanager
    def keep(self, key: tuple, slots: tuple, constants: tuple, copied: int = 0) -> Iterator[list]:
        version = tuning.choices_version()
        settled = [False]
        if version is None or self._kept.get(key) == (version, NOT_REPLAYED):
            yield settled  # (while a tuning recording is open, or for a layout that cannot be replayed)
            return
        with recorded() as launches:
            yield settled
        if settled[0] and tuning.choices_version() == version:
            replay = Replay.of(launches, slots, constants, settled[0], copied)
            if replay is not None:
                self._kept[key] = version, replay
