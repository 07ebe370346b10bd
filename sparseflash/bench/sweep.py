"""The sweep: every (shape, dtype, pattern, mode, backend) becomes one row.

A row's ``status`` is ``ok`` (timed), ``skipped`` (cannot run here: a peer without that mask,
CUDA-only on CPU, out of memory; ``reason`` says which), ``wrong`` (failed the correctness gate:
not timed, ``reason`` holds the error) or ``error`` (an unexpected exception, recorded, the sweep
goes on). The backends of one case and mode are prepared one after another (first call, gate),
then timed together, taking turns (``measure.time_steps``). Derived columns (``speedup_vs_dense``,
``speedup_vs_<peer>``, ``dropout_cost``) are filled by ``derive``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from typing import Callable, Iterable, Mapping, Optional

import torch

from sparseflash.bench import measure
from sparseflash.bench.backends import REGISTRY, UNSUPPORTED, Context, reference_bytes
from sparseflash.bench.spec import DTYPES, BenchConfig, Shape, attention_flops, draw_key_lengths, padded_density
from sparseflash.masks import BlockMask

KEY = ("mode", "head_dim", "dtype", "shape")


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:limit]


def padding(key_lengths: Optional[torch.Tensor]) -> dict:
    """The keyword a builder takes a padded batch's key lengths by: none without padding, so that a builder
    written without the argument still runs unpadded sweeps."""
    return {} if key_lengths is None else {"key_lengths": key_lengths}


class _Trusted:
    """The gate's trusted outputs for one (case, pattern), computed once and shared by every
    backend and mode: the reference on batch 0 and as many heads as fit ``reference_max_gb``;
    if not even one head fits, the first ``check.trusted`` backend that can run the case."""

    def __init__(self, cfg: BenchConfig, ctx: Context, q, k, v, do, mask: BlockMask, score_mod=None,
                 key_lengths: Optional[torch.Tensor] = None):
        self.cfg, self.ctx, self.inputs, self.mask, self.score_mod = cfg, ctx, (q, k, v, do), mask, score_mod
        self.key_lengths = None if key_lengths is None else key_lengths[:1]  # batch 0's, as the inputs are sliced
        self._cache: dict[str, Optional[dict]] = {}

    def get(self, tested: str) -> tuple[str, Optional[dict]]:
        q = self.inputs[0]
        heads = min(q.shape[1], self.cfg.check.max_heads)
        per_head = reference_bytes(1, 1, self.mask.q_len, self.mask.kv_len) / 2**30
        fit = int(self.cfg.check.reference_max_gb // per_head) if per_head > 0 else heads
        candidates = ["reference"] if fit >= 1 else []
        candidates += [t for t in self.cfg.check.trusted if t != tested and t in REGISTRY]
        for name in candidates:
            if name not in self._cache:
                self._cache[name] = self._compute(name, min(heads, fit) if name == "reference" else heads)
            if self._cache[name] is not None:
                return name, self._cache[name]
        return "", None

    def _compute(self, name: str, heads: int) -> Optional[dict]:
        backend = REGISTRY[name]
        q, k, v, do = self.inputs
        if name != "reference" and backend.skip_reason(q, self.mask, self.ctx, self.score_mod):
            return None

        def fn(qs, ks, vs, mask):
            return backend.build(qs, ks, vs, mask, self.ctx, self.score_mod, **padding(self.key_lengths))()

        try:
            return measure.trusted_outputs(fn, q, k, v, do, self.mask, heads)
        except Exception as err:  # noqa: BLE001 - a trusted backend that fails is not used
            if _is_oom(err):
                _free(self.ctx.device)
            return None


def prepare_one(row: dict, backend_name: str, mode: str, q, k, v, do, mask: BlockMask,
                cfg: BenchConfig, ctx: Context, trusted: _Trusted, score_mod=None,
                dropout_p: float = 0.0, key_lengths: Optional[torch.Tensor] = None) -> Optional[measure.Step]:
    """Build one backend on one case, run its first call and the correctness gate (not for dropout, whose
    outputs differ call by call: the tests check it against the reference); return the step to time, or
    None with ``row``'s status and reason saying why it is not timed."""
    backend = REGISTRY[backend_name]
    reason = backend.skip_reason(q, mask, ctx, score_mod, dropout_p)
    if reason:
        row.update(status="skipped", reason=reason)
        return None
    try:
        fwd = backend.build(q, k, v, mask, ctx, score_mod, dropout_p, **padding(key_lengths))
        with _kernel_configs(row), measure.compile_counts() as counts:
            (o, dgrads), row["first_call_ms"] = measure.wall_ms(lambda: measure.run_once(fwd, mode, q, k, v, do),
                                                                ctx.device)
        row.update(counts)
        if dropout_p:
            row["reason"] = "unchecked: dropout draws new outputs each call"
        elif cfg.check.enabled:
            against, expected = trusted.get(backend_name)
            row["check_against"] = against
            if expected is not None:
                tol = cfg.check.tol.get(row["dtype"], 3e-2)
                row["check_err"], message = measure.compare(o, dgrads, expected, tol)
                if message:
                    row.update(status="wrong", reason=f"{message} against {against}")
                    return None
            else:
                row["reason"] = "unchecked: no trusted backend fits this case"
        del o, dgrads
        return measure.make_step(fwd, mode, do)
    except UNSUPPORTED as err:
        row.update(status="skipped", reason=str(err))
    except Exception as err:  # noqa: BLE001 - record and go on
        _record_failure(row, err)
    finally:
        for x in q, k, v:
            x.grad = None
        if row.get("status"):
            _free(ctx.device)
    return None


@contextlib.contextmanager
def _kernel_configs(row: dict):
    """Record in ``row["kernel_configs"]`` the tile configs the Triton kernels launched with inside the
    block (rows that run them only: triton is imported only then)."""
    if row["impl"] != "triton":
        yield
        return
    from sparseflash.attention.triton import tuning

    with tuning.recording() as launched:
        yield
    row["kernel_configs"] = tuning.summary(launched)


def _record_failure(row: dict, err: BaseException) -> None:
    if _is_oom(err):
        row.update(status="skipped", reason=f"out of memory ({_first_line(err, 160)})")
    else:
        row.update(status="error", reason=_first_line(err))


def time_prepared(rows: list[dict], steps: list[measure.Step], mode: str, q, k, v, cfg: BenchConfig,
                  ctx: Context) -> None:
    """Time the prepared backends of one case and mode together (``measure.time_steps``) and fill
    their rows."""
    grads = [q, k, v] if mode != "fwd" else []
    for row, result in zip(rows, measure.time_steps(steps, ctx.device, cfg.timing, grads)):
        if isinstance(result, BaseException):
            _record_failure(row, result)
            continue
        row.update(result, status="ok")
        row["tflops"] = row["flops"] / (row["median_ms"] * 1e-3) / 1e12
    for x in grads:
        x.grad = None
    if any(row["status"] != "ok" for row in rows):
        _free(ctx.device)


def _inputs(shape: Shape, dtype, device, seed):
    """Random ``q, k, v, do`` (never zeros), leaves that require grad."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_shape = (shape.batch, shape.heads, shape.q_len, shape.head_dim)
    kv_shape = (shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim)
    make = lambda size: torch.randn(size, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, do = make(q_shape), make(kv_shape), make(kv_shape), make(q_shape)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def case_seed(cfg: BenchConfig, shape: Shape) -> int:
    """The seed of a shape's inputs and (padded batches) key lengths: a rerun draws the same."""
    return cfg.seed * 1_000_003 + shape.q_len * 31 + shape.head_dim + (shape.kv_len - shape.q_len) * 7


def count(cfg: BenchConfig) -> int:
    return len(cfg.shapes()) * len(cfg.dtypes) * len(cfg.patterns) * len(cfg.modes) * len(cfg.backends)


def sweep(cfg: BenchConfig, env: dict, on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    device = cfg.torch_device()
    ctx = Context(device, cfg.reference_max_gb, cfg.flex_dynamic)
    rows = []
    for shape in cfg.shapes():
        for dtype_name in cfg.dtypes:
            seq_len, head_dim, batch, heads = shape.q_len, shape.head_dim, shape.batch, shape.heads
            seed = case_seed(cfg, shape)
            key_lengths = None if cfg.key_lengths is None else draw_key_lengths(
                batch, shape.kv_len, cfg.key_lengths, seed).to(device)
            mean_keys = math.nan if key_lengths is None else key_lengths.double().mean().item()
            # a padded shape names its mean keys, so that no comparison takes it for the unpadded one
            shape_label = shape.label if key_lengths is None else f"{shape.label} (keys {mean_keys:.0f})"
            try:
                q, k, v, do = _inputs(shape, DTYPES[dtype_name], device, seed)
                input_error = None
            except Exception as err:  # noqa: BLE001 - OOM on the inputs: skip the whole case
                input_error = ("out of memory for the inputs" if _is_oom(err) else _first_line(err))
                _free(device)
            for pattern in cfg.patterns:
                mask = pattern.make(seq_len, cfg.block, heads, device, kv_len=shape.kv_len)
                score_mod = pattern.make_score_mod(heads, device)
                # the share of the scores computed: the mask's, less the padding's
                density = mask.density if key_lengths is None else padded_density(mask, key_lengths)
                kind = mask.kind.value
                trusted = None if input_error else _Trusted(cfg, ctx, q, k, v, do, mask, score_mod, key_lengths)
                for mode in cfg.modes:
                    case_rows, prepared = [], []
                    for backend in cfg.backends:
                        row = {
                            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "mode": mode,
                            "head_dim": head_dim, "dtype": dtype_name, "seq_len": seq_len,
                            "kv_len": shape.kv_len, "shape": shape_label,
                            "batch": batch, "heads": heads, "kv_heads": shape.kv_heads, "block": cfg.block,
                            "pattern": pattern.name, "pattern_label": pattern.label,
                            "params": pattern.params_json, "density": density, "mask_kind": kind,
                            "dropout_p": pattern.dropout_p,
                            "key_lengths_mean": mean_keys,
                            "backend": backend, "impl": REGISTRY[backend].impl(device),
                            "status": "", "reason": "",
                            "flops": attention_flops(batch, heads, seq_len, shape.kv_len, head_dim, density, mode),
                            "median_ms": math.nan, "p20_ms": math.nan, "p80_ms": math.nan,
                            "repeats": math.nan, "first_call_ms": math.nan, "compiled_kernels": math.nan,
                            "cached_kernels": math.nan, "dynamo_graphs": math.nan, "tflops": math.nan,
                            "speedup_vs_dense": math.nan, "dropout_cost": math.nan,
                            "check_against": "", "check_err": math.nan,
                            "peak_mem_mb": math.nan, "kernel_configs": "",
                        }
                        if input_error:
                            row.update(status="skipped", reason=input_error)
                        else:
                            step = prepare_one(row, backend, mode, q, k, v, do, mask, cfg, ctx, trusted,
                                               score_mod, pattern.dropout_p, key_lengths)
                            if step is not None:
                                prepared.append((row, step))
                        case_rows.append(row)
                    if prepared:
                        time_prepared([row for row, _ in prepared], [step for _, step in prepared], mode,
                                      q, k, v, cfg, ctx)
                    for row in case_rows:
                        row.update(env)
                        rows.append(row)
                        on_row(row)
                del trusted
            if not input_error:
                del q, k, v, do
            _free(device)
    return derive(rows, cfg.backends, dense_label=_dense_label(cfg), undropped=_undropped_labels(cfg))


def _dense_label(cfg: BenchConfig) -> Optional[str]:
    for p in cfg.patterns:
        if p.name == "dense":
            return p.label
    return None


def _undropped_labels(cfg: BenchConfig) -> dict[str, str]:
    """For each pattern with dropout, the label of the sweep's pattern with the same mask and score function
    and no dropout (where there is one)."""
    return {p.label: q.label for p in cfg.patterns if p.dropout_p
            for q in reversed(cfg.patterns) if not q.dropout_p and (q.mask, q.score_mod) == (p.mask, p.score_mod)}


def derive(rows: list[dict], backends: Iterable[str], dense_label: Optional[str] = "dense",
           undropped: Mapping[str, str] | None = None) -> list[dict]:
    """Fill ``speedup_vs_dense`` (the same backend's dense time / this time), for every other backend of
    the run ``speedup_vs_<peer>`` (the peer's time / this time; > 1: this one is faster), and for a
    pattern with dropout ``dropout_cost`` (this time / the same backend's time on ``undropped[label]``,
    the pattern without it; > 1: dropout's cost)."""
    undropped = undropped or {}
    backends = list(dict.fromkeys(backends))
    ok = {tuple(r[c] for c in KEY) + (r["pattern_label"], r["backend"]): r["median_ms"]
          for r in rows if r["status"] == "ok"}
    for r in rows:
        key = tuple(r[c] for c in KEY)
        mine = r["median_ms"] if r["status"] == "ok" else math.nan
        dense = ok.get(key + (dense_label, r["backend"]), math.nan)
        r["speedup_vs_dense"] = dense / mine if mine == mine and dense == dense else math.nan
        plain = ok.get(key + (undropped.get(r["pattern_label"]), r["backend"]), math.nan)
        r["dropout_cost"] = mine / plain if mine == mine and plain == plain else math.nan
        peers = {}
        for peer in backends:  # every row gets every column (NaN for its own backend)
            theirs = ok.get(key + (r["pattern_label"], peer), math.nan) if peer != r["backend"] else math.nan
            peers[f"speedup_vs_{peer}"] = theirs / mine if mine == mine and theirs == theirs else math.nan
        items = list(r.items())
        at = [k for k, _ in items].index("speedup_vs_dense") + 1
        r.clear()
        r.update(items[:at] + list(peers.items()) + [(k, v) for k, v in items[at:] if k not in peers])
    return rows
