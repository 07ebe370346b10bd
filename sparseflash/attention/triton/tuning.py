"""Tile sizes, warps and stages per (kernel, head_dim, dtype, mask kind, GPU): looked up, or tuned on request.

A kernel launches with the first config found of:
  1. this process's choice for the key (pinned, tuned, or found before);
  2. the disk cache ``$SPARSEFLASH_CACHE_DIR/tuning.json`` (default ``~/.cache/sparseflash``), where
     tuning stores its choices, keyed by GPU name and Triton version;
  3. tuning, only inside ``with tuned():`` or with ``SPARSEFLASH_TUNE=1``: each candidate config is
     timed on the real inputs (``_tune``: medians of interleaved calls) and the fastest kept, in
     memory and on disk. It costs 10-40 s per new key on an H100, which is why it is opt-in;
  4. the shipped table ``config_table.json``: configs tuned on a GPU of the same name, by
     ``scripts/build_config_table.py``, or where the table has none for this GPU, on the table's GPU
     of the same architecture (compute capability; the nearest multiprocessor count among several;
     e.g. an H200 takes an H100's configs). Taken from the nearest key (same kernel
     and head dim; then the fewest differences in mask kind, functions, dtype, block, causal,
     persistent mode, the two work buckets and decoding's rows) whose config is one of the key's
     candidates;
  5. the first candidate of the kernel's list (an architecture the table does not know).
The key also holds two log2 buckets of the problem: the loop's trip count (mask blocks per query
row) and the grid's size (batch x heads x query tiles), since short loops and small grids favour
other tiles than the long, full ones; and, for decoding, the query rows that share a K/V head,
which decide the query tile (one query per head wants 16 rows, several want 64). Sequence lengths
themselves are not specialised on: a new length compiles nothing new, except the first length that
the tiles do not divide (or, after one, do), for DENSE and CAUSAL: the EVEN_LENGTHS variant
(forward.py). Under the interpreter
(``TRITON_INTERPRET=1``) one small tile is the only candidate: it keeps the CPU tests fast and
exercises several tiles per mask block.

The public API: ``run_tuned`` (the kernels' launchers call it), ``planned`` (the config the next
launch will take, for compiling it ahead), ``tuned`` (tune new keys inside a block), ``choice`` (the
config a key would launch with, as found so far, without launching), ``pin`` (fix a key's config),
``forget`` (drop this process's choices), ``table_gpu`` (whose table entries serve a GPU; ``architecture``
is what the table records per GPU) and ``recording`` (which configs the kernels launched
inside a block, with a way to launch each again with another config: the benchmark,
``scripts/build_config_table.py`` and ``scripts/kernel_probe.py`` use it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import triton

from sparseflash.atomic_write import replacing
from sparseflash.attention.triton.launch import cache_root, cdiv, interpreting
from sparseflash.timing import interleaved_times


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows of a tile (keys for dK/dV: the tile a program holds)
    block_n: int  # key rows of a tile (the tile a program streams)
    num_warps: int
    num_stages: int
    persistent: bool = False  # forward only: the persistent, warp-specialised kernel (forward_persistent.py)

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"
                + ("/persistent" if self.persistent else ""))


@dataclass(frozen=True)
class ConfigKey:
    head_dim: int  # padded to a power of two >= 16
    dtype: str
    kind: str
    sparse_block: tuple[int, int]
    causal: bool
    row_work: int  # log2 of the mean mask blocks per query row: the loop's trip count
    parallelism: int  # log2 of batch x heads x 128-row query tiles: how well a grid fills the GPU
    device: str
    persistent: str = ""  # forward_persistent.mode(): "" never, "auto" tuned against the others, "only"
    mods: str = ""  # what else the loop does: "mask", "score", "dropout" joined by "+", or "" (registers, work);
    # "score-special" for a score function using exp, log, tanh or sqrt (Graph.uses_special_functions); the
    # backward kernels' key ends in "+grads" where they add gradients of captured tensors (plan.backward_key)
    head_dim_parts: str = ""  # a head dim computed as two parts, e.g. "64+32" (plan.head_dim_parts), or ""
    # where the kernels compute it padded
    decode_rows: int = 0  # decoding (forward_decode.py): the query rows a program group holds (the queries of
    # the heads sharing a K/V head), rounded up to a power of two >= 16; 0 where the forward is not split-KV

    @classmethod
    def of(cls, q: torch.Tensor, mask, padded_dim: int, persistent: str = "", mods: str = "",
           head_dim_parts: str = "", decode_rows: int = 0) -> "ConfigKey":
        blocks_per_row = max(1.0, mask.mean_row_blocks)
        tiles = q.shape[0] * q.shape[1] * cdiv(q.shape[2], 128)
        return cls(padded_dim, str(q.dtype).removeprefix("torch."), mask.kind.name,
                   tuple(mask.block_size), mask.causal, round(math.log2(blocks_per_row)),
                   round(math.log2(tiles)), _device_name(q.device), persistent, mods, head_dim_parts, decode_rows)

    @property
    def columns(self) -> int:
        """The head-dim columns the kernel computes: the parts' sum, or the padded head dim."""
        return sum(map(int, self.head_dim_parts.split("+"))) if self.head_dim_parts else self.head_dim

    def __str__(self) -> str:  # head_dim_parts and decode_rows only where set: the other keys keep their names
        values = [v for name, v in asdict(self).items() if name not in ("head_dim_parts", "decode_rows") or v]
        return "|".join(str(v) for v in values) + f"|triton-{triton.__version__}"


INTERPRETER_DEVICE = "interpreter"  # the device name of keys made under the interpreter (no CUDA device)


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else INTERPRETER_DEVICE


def _configs(*rows: tuple[int, int, int, int]) -> list[KernelConfig]:
    return [KernelConfig(*row) for row in rows]


# Candidates per kernel and head-dim columns (``ConfigKey.columns``; a key takes the list of the
# smallest width >= its own), best guess first, as (BLOCK_M held, BLOCK_N streamed): forward and dq
# hold queries and stream keys, dkdv holds keys and streams queries; backward launches both kinds of
# program at once (padded head dims >= 128, backward.py).
CANDIDATES: dict[str, dict[int, list[KernelConfig]]] = {
    "forward": {
        64: _configs((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3)),
        # 80 (64 + 16) and 96 (64 + 32): 4 warps, 128x64 tiles 10-12 % ahead of hd128's first (H100)
        96: _configs((128, 64, 4, 3), (64, 64, 4, 2), (128, 64, 4, 2), (128, 128, 8, 3), (64, 64, 4, 4)),
        128: _configs((128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 2), (64, 64, 4, 3),
                      (64, 64, 4, 2), (64, 128, 4, 2)),
        # 160 (128 + 32) and 192 (128 + 64): the parts leave shared memory for 3 stages, 1.3x 2 stages (H100)
        192: _configs((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)),
        256: _configs((128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
    },
    # split-KV forward for <= 16 query rows (forward_decode.py) where a program group holds 16 of them (one
    # query, or a few, per head); streaming K and V bounds its time. Taller groups: DECODE_TALL below.
    # hd128: a 64-row tile (Hopper's warpgroup dot) is within 1.6 % of the best on these rows too (H100)
    "decode": {
        64: _configs((16, 128, 4, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 32, 4, 3)),
        128: _configs((64, 64, 4, 3), (16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 4, 2), (16, 32, 4, 3)),
        256: _configs((16, 64, 4, 3), (64, 32, 4, 3), (16, 64, 4, 2), (16, 32, 4, 2)),
    },
    "dq": {64: _configs((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)),
           # 128 queries on 8 warps: a 64-row tile's scores are computed by both warpgroups (backward.py);
           # 2.1x the fused backward's 64x64/w8/s2 on dQ (H200, dense S=4096)
           256: _configs((128, 32, 8, 3), (128, 64, 8, 1), (128, 32, 8, 2))},
    "dkdv": {64: _configs((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)),
             # 64 keys (128 keys' dK and dV spill) and 128 queries, the scores query-major (QUERY_ROWS):
             # 1.8-1.9x 64x64/w8/s2 (H200, dense and causal S=4096); one stage: two need 337 KB of shared memory
             256: _configs((64, 128, 8, 1), (64, 32, 8, 3), (64, 64, 8, 2))},
    "backward": {
        # 80 and 96 columns: 64x64 tiles with 4 warps, 8 % ahead of 128x64/w8 (H200)
        96: _configs((64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3)),
        128: _configs((128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3),
                      (128, 32, 8, 2), (128, 128, 8, 2)),
        # 160 (128 + 32) and 192 (128 + 64): 128-key tiles fit without the padding, 1.7-2x 64x64/w8 (H200)
        192: _configs((128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 8, 3), (64, 64, 8, 2)),
        # 8 warps: with 4, a 64-key tile's dK and dV (2 x 64 x 256 fp32) spill from 128 threads' registers
        256: _configs((64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)),
    },
}
# The split-KV forward where a program group holds 32-256 query rows (``ConfigKey.decode_rows``: several
# queries per head of a GQA group): 64-row tiles, whose products Hopper's warpgroup dot computes (m64), and
# which stream a K/V head once for 64 rows; 16-row tiles were up to 2.7x slower there (H100, bf16).
DECODE_TALL: dict[int, list[KernelConfig]] = {
    64: _configs((64, 64, 4, 3), (64, 64, 4, 2), (32, 128, 4, 2)),
    128: _configs((64, 64, 4, 3), (64, 64, 4, 2), (32, 128, 4, 2)),
    256: _configs((64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2)),
}
DECODE_ROWS_SHORT = 16  # decode_rows up to which the "decode" list applies
# The persistent forward, where the key allows it: 4 warps, the only count Triton's warp
# specialisation splits among two consumer warpgroups, and 2 stages (3 give NaN under Triton 3.6;
# docs/kernels.md, "Triton bugs worked around").
PERSISTENT_FORWARD = [KernelConfig(128, 128, 4, 2, True), KernelConfig(128, 64, 4, 2, True)]
INTERPRETER_TILE = 32


def fit(kernel: str, cfg: KernelConfig, key: ConfigKey) -> KernelConfig:
    """``cfg`` with its tiles cut down to divide the mask blocks (all sizes are powers of two)."""
    limit_m, limit_n = key.sparse_block
    if kernel == "dkdv":  # keys held, queries streamed
        limit_m, limit_n = limit_n, limit_m
    elif kernel == "backward":  # its tiles serve both ways round, so each must divide both sides
        limit_m = limit_n = min(limit_m, limit_n)
    return replace(cfg, block_m=min(cfg.block_m, limit_m), block_n=min(cfg.block_n, limit_n))


def candidates(kernel: str, key: ConfigKey) -> list[KernelConfig]:
    """The configs to try, fitted to the mask blocks, duplicates removed."""
    persistent = key.persistent if kernel == "forward" else ""
    if interpreting():
        return [fit(kernel, KernelConfig(INTERPRETER_TILE, INTERPRETER_TILE, 4, 1, persistent == "only"), key)]
    table = DECODE_TALL if kernel == "decode" and key.decode_rows > DECODE_ROWS_SHORT else CANDIDATES[kernel]
    head_dim = min((d for d in table if d >= key.columns), default=max(table))
    options = {"": table[head_dim], "auto": table[head_dim] + PERSISTENT_FORWARD, "only": PERSISTENT_FORWARD}[persistent]
    return list(dict.fromkeys(fit(kernel, cfg, key) for cfg in options))


# ---------------------------------------------------------------------------- the disk cache
def _cache_path() -> Path:
    return cache_root() / "tuning.json"


def _load_disk_cache() -> dict[str, dict]:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_choice(name: str, cfg: KernelConfig) -> None:
    path = _cache_path()
    try:
        cache = _load_disk_cache()
        cache[name] = asdict(cfg)
        with replacing(path) as tmp:
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home only costs re-tuning in the next process


# ---------------------------------------------------------------------------- the tuner
FIRST_ROUND_MS = 25  # one timing of every candidate (compiling it): the slow ones are dropped after it
SLOWER_THAN_BEST = 1.2  # ... those whose median is this many times the fastest one's
TUNING_ROUNDS = 4  # then the rest take turns for this many rounds; the lowest median of their calls wins
ROUND_MS = 25  # a round gives each ROUND_MS, or ROUND_CALLS calls of the fastest if that is longer
ROUND_CALLS = 20  # (up to MAX_ROUND_MS): a kernel of milliseconds is judged under sustained load,
MAX_ROUND_MS = 200  # where the power cap slows some configs more than others (docs/kernels.md, "The tuner")


def round_ms(fastest_ms: float) -> float:
    """Each finalist's time per tuning round, given the fastest first-round median."""
    return min(MAX_ROUND_MS, max(ROUND_MS, ROUND_CALLS * fastest_ms))


def _tune(launch: Callable[[KernelConfig], object], options: list[KernelConfig]) -> KernelConfig:
    """The fastest of ``options``. The survivors of a first round are timed in interleaved rounds
    (``sparseflash.timing``) of ``round_ms`` each, so that the drift of the GPU's clocks over the
    seconds that tuning takes does not decide between configs a few per cent apart."""
    first = interleaved_times([functools.partial(launch, cfg) for cfg in options], 1, FIRST_ROUND_MS,
                              FIRST_ROUND_MS, catch=(triton.runtime.errors.OutOfResources,))  # e.g. too much shared memory
    fitting = {cfg: statistics.median(times) for cfg, times in zip(options, first) if isinstance(times, list)}
    if not fitting:
        raise RuntimeError(f"no kernel config fits this GPU; tried {options}")
    fastest = min(fitting.values())
    finalists = [cfg for cfg, ms in fitting.items() if ms <= SLOWER_THAN_BEST * fastest]
    if len(finalists) == 1:
        return finalists[0]
    rep_ms = round_ms(fastest)
    times = interleaved_times([functools.partial(launch, cfg) for cfg in finalists], TUNING_ROUNDS, rep_ms,
                              rep_ms / 5)
    medians = [statistics.median(t) for t in times]
    return finalists[medians.index(min(medians))]


def _first_fitting(launch: Callable[[KernelConfig], Optional[KernelConfig]], failed: KernelConfig,
                   error: Exception, options: list[KernelConfig]) -> tuple[KernelConfig, KernelConfig]:
    """After ``failed`` did not fit the GPU (``error``), launch the first other config of ``options`` that fits:
    (that config, the config that ran)."""
    for cfg in options:
        if cfg == failed:
            continue
        try:
            return cfg, launch(cfg) or cfg
        except triton.runtime.errors.OutOfResources as out_of_resources:
            error = out_of_resources
    raise RuntimeError(f"no kernel config fits this GPU; tried {failed} and {options}") from error


# This process's choices, by (kernel, key), and the pinned ones among them; only the functions below read or
# write them.
_chosen: dict[tuple[str, ConfigKey], KernelConfig] = {}
_pinned: set[tuple[str, ConfigKey]] = set()
# Counts the tunes and the changes of a choice made (a pin, a fallback, ``forget``): a call launched again without
# the choosing (replay.py) was recorded under one count, and is recorded again after a change. A key's first choice
# changes no call recorded before it (a decoding loop meets a new key at each length).
_version = 0


def _changed() -> None:
    global _version
    _version += 1


def _chose(kernel: str, key: ConfigKey, cfg: KernelConfig) -> None:
    if _chosen.get((kernel, key), cfg) != cfg:
        _changed()
    _chosen[kernel, key] = cfg


def choices_version() -> Optional[int]:
    """The count of changes of this process's choices; None while a ``recording`` block is open (every
    launch must then go through ``run_tuned``, which records it)."""
    return None if _recorders else _version


def choice(kernel: str, key: ConfigKey) -> Optional[KernelConfig]:
    """The config ``kernel`` launches with for ``key``: pinned, tuned or looked up in this process, or
    found in the disk cache; None when its next launch decides (tuning, the shipped table or the
    first candidate)."""
    cfg = _chosen.get((kernel, key))  # a tuple key: no string is built on the hot path
    if cfg is None:
        stored = _load_disk_cache().get(f"{kernel}|{key}")
        if stored is not None and KernelConfig(**stored) in candidates(kernel, key):
            cfg = _chosen[kernel, key] = KernelConfig(**stored)
    return cfg


def pin(kernel: str, key: ConfigKey, cfg: KernelConfig) -> None:
    """Launch ``kernel`` with ``cfg`` for ``key`` from now on in this process (no tuning), also where it does not
    fit the GPU (the launch then reports)."""
    _chose(kernel, key, cfg)
    _pinned.add((kernel, key))


def forget() -> None:
    """Drop this process's pinned and tuned choices (the disk cache stays)."""
    _changed()
    _chosen.clear()
    _pinned.clear()


# ---------------------------------------------------------------------------- the shipped table
TABLE_PATH = Path(__file__).with_name("config_table.json")
# What a difference between two keys costs when the nearest table entry is sought: the mask kind
# and the functions change the loop most, then the dtype, the block shape and causal; each log2 step
# of the two work buckets counts 1, and so does the persistent mode (a key where the persistent
# forward does not apply, e.g. a ragged length, takes the nearest entry whose config is not
# persistent: ``from_table`` keeps only the key's candidates).
MISMATCH_COST = {"kind": 4, "mods": 4, "dtype": 3, "sparse_block": 2, "causal": 2, "persistent": 1}
SAME_REQUIRED = ("head_dim", "head_dim_parts")
DECODE_ROWS_COST = 2  # per log2 step of decode_rows: 16 and 64 rows want other tiles (DECODE_TALL)


@functools.lru_cache(maxsize=1)
def _table_file() -> dict:
    """config_table.json as read (empty where it is missing: every key then takes its first candidate)."""
    try:
        return json.loads(TABLE_PATH.read_text())
    except FileNotFoundError:
        return {}


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, list[tuple[str, ConfigKey, KernelConfig]]]:
    """The shipped table by GPU name: ``(kernel, key, config)`` entries."""
    table: dict[str, list] = {}
    for entry in _table_file().get("entries", []):
        key = ConfigKey(**{**entry["key"], "sparse_block": tuple(entry["key"]["sparse_block"])})
        table.setdefault(key.device, []).append((entry["kernel"], key, KernelConfig(**entry["config"])))
    return table


def _table_gpus() -> dict[str, dict]:
    """The table's GPUs by name: their ``architecture`` (where the table recorded it) and versions."""
    return _table_file().get("built_on", {})


def architecture(device: int) -> dict:
    """``{"capability": "major.minor", "multiprocessors": n}`` of CUDA device ``device``."""
    properties = torch.cuda.get_device_properties(device)
    return {"capability": f"{properties.major}.{properties.minor}", "multiprocessors": properties.multi_processor_count}


@functools.lru_cache(maxsize=None)
def _architecture_named(device_name: str) -> Optional[dict]:
    """``architecture`` of this machine's CUDA device named ``device_name``; None where it has none (and
    without touching CUDA for the interpreter's keys, so that a CPU process does not initialise it)."""
    if device_name == INTERPRETER_DEVICE or not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if torch.cuda.get_device_name(i) == device_name:
            return architecture(i)
    return None


def table_gpu(device_name: str) -> Optional[str]:
    """The table's GPU whose entries serve ``device_name``: itself where the table has entries for it,
    else the one of the same compute capability (the nearest multiprocessor count among several; an
    H200 takes an H100's entries), else None."""
    if device_name in _table():
        return device_name
    here = _architecture_named(device_name)
    if here is None:
        return None
    siblings = [(abs(gpu.get("multiprocessors", 0) - here["multiprocessors"]), name)
                for name, gpu in _table_gpus().items()
                if gpu.get("capability") == here["capability"] and name in _table()]
    return min(siblings)[1] if siblings else None


def key_distance(a: ConfigKey, b: ConfigKey) -> float:
    """How far apart two keys of one kernel are, whatever their GPUs (``table_gpu`` picks those; inf:
    never substitute one for the other)."""
    if any(getattr(a, f) != getattr(b, f) for f in SAME_REQUIRED):
        return math.inf
    cost = sum(weight for field, weight in MISMATCH_COST.items() if getattr(a, field) != getattr(b, field))
    rows_steps = abs(a.decode_rows.bit_length() - b.decode_rows.bit_length())  # log2 steps (0: no decode key)
    return cost + abs(a.row_work - b.row_work) + abs(a.parallelism - b.parallelism) + DECODE_ROWS_COST * rows_steps


def from_table(kernel: str, key: ConfigKey, options: list[KernelConfig]) -> Optional[KernelConfig]:
    """The config of the table's nearest key to ``key`` that is one of ``options`` (fitted to the
    key's blocks), among the entries of ``table_gpu(key.device)``; or None."""
    gpu = table_gpu(key.device)
    if gpu is None:
        return None
    best, best_cost = None, math.inf
    for entry_kernel, entry_key, cfg in _table()[gpu]:
        if entry_kernel != kernel:
            continue
        cost, fitted = key_distance(key, entry_key), fit(kernel, cfg, key)
        if cost < best_cost and fitted in options:
            best, best_cost = fitted, cost
    return best


def table_entries(*passes: list["Launched"]) -> list[dict]:
    """Entries of the shipped table from the launches of one or more independent tuning passes: per
    kernel and key, the config most passes chose (the earliest pass's on a tie; within a pass, its
    last launch). One pass can miss a config a few per cent faster (docs/kernels.md)."""
    votes: dict[tuple, Counter] = {}
    for launched in passes:
        latest = {(entry.kernel, entry.key): entry.config for entry in launched}
        for name, cfg in latest.items():
            votes.setdefault(name, Counter())[cfg] += 1
    return [{"kernel": kernel, "key": asdict(key), "config": asdict(count.most_common(1)[0][0])}
            for (kernel, key), count in votes.items()]


@dataclass(frozen=True)
class Launched:
    """One kernel launch seen by ``recording``: the kernel, its key and config, and ``relaunch``,
    which launches the same kernel on the same tensors with another config."""

    kernel: str
    key: ConfigKey
    config: KernelConfig
    relaunch: Callable[[KernelConfig], object]


# The open ``recording`` blocks and ``tuned`` blocks of this process. Process-wide, not context
# variables: the backward kernels launch from autograd's device threads, which see no context of
# the thread that opened the block.
_recorders: list[list[Launched]] = []
_tuning_blocks: list[None] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Launched]]:
    """``with recording() as launched:`` collects every tuned kernel launch made while the block is
    open (autograd's backward threads included), in order."""
    launched: list[Launched] = []
    _recorders.append(launched)
    try:
        yield launched
    finally:
        _recorders.remove(launched)


def summary(launched: list[Launched]) -> str:
    """``kernel=BLOCK_MxBLOCK_N/wWARPS/sSTAGES`` of each kernel's latest launch in ``launched``."""
    latest = {entry.kernel: entry.config for entry in launched}
    return " ".join(f"{kernel}={cfg}" for kernel, cfg in latest.items())


@contextlib.contextmanager
def tuned() -> Iterator[None]:
    """``with tuned():`` kernels launched while the block is open tune each key they meet for the
    first time (on this GPU: not found in this process or the disk cache) and store the choice on disk."""
    _tuning_blocks.append(None)
    try:
        yield
    finally:
        _tuning_blocks.pop()


def tuning_requested() -> bool:
    """Inside ``tuned()``, or ``SPARSEFLASH_TUNE=1`` in the environment."""
    return bool(_tuning_blocks) or os.environ.get("SPARSEFLASH_TUNE", "0") == "1"


def planned(kernel: str, key: ConfigKey) -> Optional[KernelConfig]:
    """The config that ``kernel``'s next launch for ``key`` will run with, or None where that launch
    tunes first."""
    cfg = choice(kernel, key)
    if cfg is None:
        options = candidates(kernel, key)
        if len(options) > 1 and tuning_requested():
            return None
        cfg = from_table(kernel, key, options) or options[0]
    return cfg


def run_tuned(kernel: str, key: ConfigKey, launch: Callable[[KernelConfig], Optional[KernelConfig]]) -> KernelConfig:
    """Launch ``kernel`` with its config for ``key`` (the module docstring says which) and return the
    config it ran with: ``launch(cfg)`` returns the config that ran, or None where that is cfg. Where the config
    does not fit the GPU (a key covers variants of unequal needs: a mask function, key_lengths; or the table's
    entry was built for another GPU), the first candidate that fits runs instead, and from then on in this
    process; a pinned config is launched as it is."""
    cfg = planned(kernel, key)
    if cfg is None:
        cfg = _tune(launch, candidates(kernel, key))
        _save_choice(f"{kernel}|{key}", cfg)
        _changed()  # (a call that tuned launched every candidate: not one to replay)
    try:
        used = launch(cfg) or cfg
    except triton.runtime.errors.OutOfResources as error:
        if (kernel, key) in _pinned:
            raise
        cfg, used = _first_fitting(launch, cfg, error, candidates(kernel, key))
        _changed()
    _chose(kernel, key, cfg)
    for launched in list(_recorders):
        launched.append(Launched(kernel, key, used, launch))
    return used
