"""Device tensors kept across calls (built masks, launch plans and their tables, scratch buffers), made
outside any CUDA graph memory pool.

``torch.compile(mode="reduce-overhead")`` runs a compiled graph's first calls with the allocations of
the calling thread (torch >= 2.8; of its stream before) routed to its CUDA graph pool, and then checks
that nothing allocated there outlives the call except the graph's outputs: a plan kept on the mask would
fail that check ("tensors in the cudagraph pool not tracked as outputs"), and its memory could be handed
out again under it. So what is kept is made on a thread of this module's, on a stream of its own, which
neither routing catches. That stream waits for the caller's (``make`` may read what the caller's stream
is still writing), and the caller's stream waits for it (the caller uses what ``make`` wrote): no host
sync. A block later freed returns to that stream's pool, where only the next ``make``, which again waits
for the caller's stream first, can take it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
_maker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseflash-kept")  # its thread starts at first use
_on_maker = threading.local()  # set on the maker's thread: a call from there runs inline
_streams: dict[torch.device, torch.cuda.Stream] = {}  # used by the maker's thread only


def made_outside_graph_pools(make: Callable[[], T], device: torch.device) -> T:
    """``make()``, run where its CUDA allocations land in the ordinary pool (see the module's docstring):
    on this module's thread and stream for a CUDA ``device`` (without an index: the current one), inline
    for any other device or when called from that thread. Inside a CUDA graph capture nothing may be
    made that outlives the call: that is an error saying what to do instead."""
    if device.type != "cuda" or getattr(_on_maker, "active", False):
        return make()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "sparseflash had to build a mask, a launch plan or a table inside a CUDA graph capture, where "
            "nothing it keeps may be allocated. Run the call once before capturing it (torch.compile's "
            "mode='reduce-overhead' does), and make the tensors that masks and score functions capture static "
            "(module parameters or buffers, or torch._dynamo.mark_static_address) so that the capture sees "
            "the ones the warm-up call saw.")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    caller = torch.cuda.current_stream(device)

    def on_maker() -> T:
        _on_maker.active = True
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(caller)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            made = make()
        caller.wait_stream(stream)
        return made

    return _maker.submit(on_maker).result()
