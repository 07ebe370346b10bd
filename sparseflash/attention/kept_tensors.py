"""Device tensors kept across calls (built masks, launch plans and their tables, scratch buffers), made
outside any CUDA graph memory pool.

``torch.compile(mode="reduce-overhead")`` runs a compiled graph's first calls with every allocation of
the calling thread routed to its CUDA graph pool, and then checks that nothing allocated there outlives
the call except the graph's outputs: a plan kept on the mask would fail that check ("tensors in the
cudagraph pool not tracked as outputs"), and its memory could be handed out again under it. So what is
kept is made on a thread of its own, whose allocations go to the ordinary caching allocator.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
THREAD_NAME = "sparseflash-kept"
_maker: ThreadPoolExecutor | None = None


def made_outside_graph_pools(make: Callable[[], T], device: torch.device) -> T:
    """``make()``, run where its CUDA allocations land in the ordinary pool, its copies finished: on a
    thread of this module's for a CUDA ``device`` (as the current device there), else here: for another
    device, inside a CUDA graph capture (which cannot wait for another stream's work), and on that
    thread itself (a plan that builds its mask's tables)."""
    global _maker
    if (device.type != "cuda" or torch.cuda.is_current_stream_capturing()
            or threading.current_thread().name.startswith(THREAD_NAME)):
        return make()
    if _maker is None:
        _maker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)

    def on_device() -> T:
        with torch.cuda.device(device):
            made = make()
            torch.cuda.current_stream().synchronize()  # the caller's stream may use it at once
        return made

    return _maker.submit(on_device).result()
