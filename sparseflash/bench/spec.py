"""What a sweep measures: the config, read into plain Python, and the FLOP count.

The config is a mapping (a Hydra ``DictConfig`` or a dict); every key has a default, so
``BenchConfig.from_cfg({"seq_lens": [256], "backends": ["reference"]})`` is a whole sweep.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from sparseflash import masks
from sparseflash.attention.dropout import check_p
from sparseflash.attention.score_mods import make_score_mod, registered_score_mods
from sparseflash.bench.backends import REGISTRY

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
MODES = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "fwdbwd", "fwd+bwd": "fwdbwd", "fwd_bwd": "fwdbwd"}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}  # backward = 2.5 x forward (FA2 convention)


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    density: float, mode: str) -> float:
    """FLOPs of the computed scores: ``4 * S_q * S_kv * D`` per head per forward (two matmuls of
    ``2 * S_q * S_kv * D``), times the mask's exact density; backward 2.5x, fwd+bwd 3.5x."""
    return 4.0 * batch * heads * q_len * kv_len * head_dim * density * FLOP_FACTOR[mode]


def draw_key_lengths(batch: int, kv_len: int, fraction: float, seed: int) -> torch.Tensor:
    """(batch,) int64: a padded batch's key lengths, drawn uniformly from [ceil(fraction * kv_len), kv_len] by a
    generator seeded with ``seed``, the shortest first and below kv_len where the range allows: the benchmark's
    correctness gate checks batch 0, which then has padding."""
    low = math.ceil(fraction * kv_len)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(low, kv_len + 1, (batch,), generator=gen).sort().values
    lengths[0] = min(int(lengths[0]), max(low, kv_len - 1))
    return lengths


def kept_per_key(mask: masks.BlockMask, rows: int = 1024) -> torch.Tensor:
    """(kv_len,) int64: how many scores of each key a mask keeps, over its query rows and layout heads (and
    batch): ``BlockMask.to_dense`` summed over the queries, ``rows`` queries at a time, so that no
    q_len x kv_len tensor is built (4 GiB of bools for 16 heads of 16k x 16k)."""
    return sum(mask.to_dense(range(start, min(start + rows, mask.q_len))).reshape(-1, mask.kv_len).sum(0)
               for start in range(0, mask.q_len, rows))


def padded_density(mask: masks.BlockMask, key_lengths: torch.Tensor) -> float:
    """The share of a (batch, head)'s q_len x kv_len scores computed, on average over the batch, when batch b's
    keys end at ``key_lengths[b]`` (``mask.density`` where every batch has all its keys)."""
    if mask.layout.dim() != 3:
        raise ValueError(f"padded_density takes a mask without a batch dim; got a layout of shape "
                         f"{tuple(mask.layout.shape)}")
    counts = kept_per_key(mask)
    before = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # scores kept before each key
    kept = before[key_lengths.to(before.device).clamp(0, mask.kv_len)]
    return kept.double().mean().item() / (mask.layout.shape[0] * mask.q_len * mask.kv_len)


@dataclass(frozen=True)
class PatternSpec:
    """A mask of the sweep, its block left to the sweep's ``block``, optionally a registered score
    function (``score_mod``: its name and parameters) and dropout on the probabilities (``dropout_p``);
    ``label`` names it in rows and plots."""

    mask: masks.MaskSpec
    label: str
    score_mod: tuple[str, tuple] | None = None
    dropout_p: float = 0.0

    @property
    def name(self) -> str:
        return self.mask.pattern

    @property
    def params(self) -> tuple:
        return self.mask.params

    def make(self, q_len: int, block: int, heads: int, device=None, kv_len: int | None = None) -> masks.BlockMask:
        return dataclasses.replace(self.mask, block=block).build(q_len, kv_len, heads=heads, device=device)

    def make_score_mod(self, heads: int, device: torch.device):
        """The score function for ``heads`` heads, its tensors on ``device`` (None without one)."""
        if self.score_mod is None:
            return None
        fn = make_score_mod(self.score_mod[0], heads, **dict(self.score_mod[1]))
        return fn.to(device) if isinstance(fn, torch.nn.Module) else fn

    @property
    def params_json(self) -> str:
        return json.dumps(dict(self.params), sort_keys=True)


def _plain(value: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with hydra-core
        pass
    return value


def _as_list(value: Any) -> list:
    value = _plain(value)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


ENTRY_KEYS = ("name", "params", "label", "causal", "score_mod", "dropout")


def _score_mod_entry(value: Any) -> tuple[str, tuple] | None:
    """A pattern entry's ``score_mod``: a registered name or ``{name: ..., params: {...}}``."""
    if value is None:
        return None
    name, params = (value, {}) if isinstance(value, str) else (value.get("name"), dict(value.get("params") or {}))
    if name not in registered_score_mods():
        raise ValueError(f"unknown score_mod {name!r}; registered: {', '.join(registered_score_mods())}")
    return str(name), tuple(sorted(params.items()))


def parse_patterns(entries: Any, defaults: Mapping[str, Mapping] | None = None) -> list[PatternSpec]:
    """``[dense, {name: local, params: {window: 4}}, ...]`` -> ``PatternSpec`` list.

    A string entry takes the defaults of ``pattern_params[name]`` (e.g. ``local: {window: 2}``); a
    mapping's ``params`` are merged over them; ``causal`` adds the causal predicate, ``score_mod`` a
    registered score function (``alibi`` or ``{name: softcap, params: {cap: 30}}``), ``dropout`` a drop
    probability; ``label`` is optional (default ``name`` or ``name(k=v,...)`` when it has parameters,
    then ``causal``, the score function and the dropout)."""
    defaults = _plain(defaults) or {}
    out = []
    for entry in _as_list(entries):
        entry = _plain(entry)
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, Mapping) or "name" not in entry:
            raise ValueError(f"a pattern is a name or {{name: ..., params: {{...}}}}; got {entry!r}")
        unknown = set(entry) - set(ENTRY_KEYS)
        if unknown:
            raise ValueError(f"pattern entry {entry!r}: unknown keys {sorted(unknown)} (use {', '.join(ENTRY_KEYS)})")
        name, label = entry["name"], entry.get("label")
        # checked here: an unknown name lists the registered ones, an unknown parameter the pattern's
        mask = masks.MaskSpec(name, {**dict(defaults.get(name) or {}), **dict(entry.get("params") or {})},
                              causal=bool(entry.get("causal", False)), per_head=True)
        score_mod = _score_mod_entry(entry.get("score_mod"))
        dropout_p = check_p(entry.get("dropout", 0.0), f"pattern entry {entry!r}: dropout")
        if label is None:
            label = name + ("(" + ",".join(f"{k}={v}" for k, v in mask.params) + ")" if mask.params else "")
            label += " causal" if mask.causal and not masks.get(name).causal else ""
            label += f" +{score_mod[0]}" if score_mod else ""
            label += f" +dropout {dropout_p:g}" if dropout_p else ""
        out.append(PatternSpec(mask, str(label), score_mod, dropout_p))
    labels = [p.label for p in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"pattern labels must be unique; got {labels} (give entries a label)")
    return out


@dataclass(frozen=True)
class Shape:
    """One problem size: q ``(batch, heads, q_len, head_dim)``, k and v ``(batch, kv_heads, kv_len,
    head_dim)``; ``label`` names it in rows and tables."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int

    @property
    def label(self) -> str:
        if (self.q_len, self.kv_heads) == (self.kv_len, self.heads):
            return str(self.q_len)
        gqa = f" H{self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"{self.q_len}x{self.kv_len}{gqa} B{self.batch}"


CASE_KEYS = ("q_len", "kv_len", "head_dim", "heads", "kv_heads", "batch")


def parse_cases(entries: Any) -> list[dict]:
    """``cases: [{q_len: 1, kv_len: 32768, head_dim: 128, heads: 32, kv_heads: 8, batch: 8}, ...]``:
    shapes given one by one (decoding, GQA, lengths off any grid), checked here. ``q_len`` and
    ``head_dim`` are required; ``kv_len`` defaults to ``q_len``, ``heads`` to ``hidden // head_dim``,
    ``kv_heads`` to ``heads``, ``batch`` to the sweep's ``batch`` or ``tokens // max(q_len, kv_len)``."""
    out = []
    for entry in _as_list(entries):
        entry = _plain(entry)
        if not isinstance(entry, Mapping) or not {"q_len", "head_dim"} <= set(entry):
            raise ValueError(f"a case is {{q_len: ..., head_dim: ..., [kv_len, heads, kv_heads, batch]}}; got {entry!r}")
        unknown = set(entry) - set(CASE_KEYS)
        if unknown:
            raise ValueError(f"case {entry!r}: unknown keys {sorted(unknown)} (use {', '.join(CASE_KEYS)})")
        case = {key: int(value) for key, value in entry.items() if value is not None}
        if any(value < 1 for value in case.values()):
            raise ValueError(f"case {entry!r}: every size must be >= 1")
        out.append(case)
    return out


@dataclass
class Timing:
    warmup_ms: float = 25.0  # do_bench warm-up time (CUDA); CPU: at least one warm-up call
    rep_ms: float = 100.0  # time spent on repeats per case
    rounds: int = 3  # CUDA: the backends of a case take turns, rep_ms / rounds each per round
    min_repeats: int = 3
    max_repeats: int = 1000
    slow_ms: float = 1000.0  # a warm call slower than this is timed with min_repeats plain calls
    quantiles: tuple[float, float] = (0.2, 0.8)  # the spread reported beside the median
    # CUDA, fwd only: time the replay of a CUDA graph of each call, i.e. the GPU's time without the host's
    # launches, as under torch.compile(mode="reduce-overhead"); a decoding step is host-bound otherwise
    cuda_graph: bool = False

    def __post_init__(self):
        if int(self.rounds) < 1:
            raise ValueError(f"timing.rounds must be at least 1; got {self.rounds}")


@dataclass
class Check:
    enabled: bool = True
    reference_max_gb: float = 4.0  # the reference runs on as many heads of batch 0 as fit
    max_heads: int = 4  # heads compared (of batch 0)
    trusted: list[str] = field(default_factory=lambda: ["sparseflash-blocked", "sdpa"])
    tol: dict[str, float] = field(default_factory=lambda: {"fp32": 5e-3, "fp16": 1e-2, "bf16": 3e-2})


@dataclass
class Plots:
    enabled: bool = True
    combined: bool = False  # one time figure and one speed-up figure for all groups


@dataclass
class BenchConfig:
    seq_lens: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    cases: list[dict] = field(default_factory=list)  # explicit shapes (parse_cases): replace seq_lens x head_dims
    tokens: int = 16384  # fixed total tokens: batch = tokens // seq_len ...
    batch: int | None = None  # ... unless a batch is given
    hidden: int = 2048
    heads: int | None = None  # default hidden // head_dim
    head_dims: list[int] = field(default_factory=lambda: [128])
    dtypes: list[str] = field(default_factory=lambda: ["bf16"])
    block: int = masks.DEFAULT_BLOCK
    patterns: list[PatternSpec] = field(default_factory=lambda: parse_patterns(["dense", "causal"]))
    backends: list[str] = field(default_factory=lambda: ["sparseflash"])
    modes: list[str] = field(default_factory=lambda: ["fwd"])
    device: str = "auto"
    seed: int = 0
    reference_max_gb: float = 8.0  # the reference backend is timed only below this estimate
    timing: Timing = field(default_factory=Timing)
    check: Check = field(default_factory=Check)
    plots: Plots = field(default_factory=Plots)
    flex_dynamic: bool | None = None
    # padded batches: batch b's keys end at a length drawn from [key_lengths * kv_len, kv_len] (None: no padding)
    key_lengths: float | None = None
    progress: bool = True
    print_table: bool = True
    out_dir: str | None = None
    wandb: dict | None = None

    @classmethod
    def from_cfg(cls, cfg: Any) -> "BenchConfig":
        cfg = dict(_plain(cfg) or {})
        known = {f.name for f in dataclasses.fields(cls)} | {"head_dim", "dtype", "pattern_params", "logger"}
        ignored = {"hydra", "bench", "name", "import_patterns"}  # import_patterns: used by run()
        unknown = set(cfg) - known - ignored
        if unknown:
            raise ValueError(f"unknown bench config keys: {sorted(unknown)}")
        kw: dict[str, Any] = {}
        for key in ("tokens", "batch", "hidden", "heads", "block", "device", "seed", "reference_max_gb",
                    "flex_dynamic", "progress", "print_table", "out_dir"):
            if key in cfg:
                kw[key] = cfg[key]
        if cfg.get("key_lengths") is not None:
            fraction = cfg["key_lengths"]
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ValueError(f"key_lengths must be a fraction in (0, 1] (each batch's keys end at a length drawn "
                                 f"from [key_lengths * kv_len, kv_len]) or null; got {fraction!r}")
            kw["key_lengths"] = float(fraction)
        if "seq_lens" in cfg:
            kw["seq_lens"] = [int(s) for s in _as_list(cfg["seq_lens"])]
        if cfg.get("cases"):
            kw["cases"] = parse_cases(cfg["cases"])
        if "head_dim" in cfg or "head_dims" in cfg:
            kw["head_dims"] = [int(d) for d in _as_list(cfg.get("head_dim", cfg.get("head_dims")))]
        if "dtype" in cfg or "dtypes" in cfg:
            names = [str(d) for d in _as_list(cfg.get("dtype", cfg.get("dtypes")))]
            for name in names:
                if name not in DTYPES:
                    raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
            kw["dtypes"] = [DTYPE_NAMES[DTYPES[n]] for n in names]
        if "patterns" in cfg:
            kw["patterns"] = parse_patterns(cfg["patterns"], cfg.get("pattern_params"))
        if "backends" in cfg:
            kw["backends"] = [str(b) for b in _as_list(cfg["backends"])]
            for name in kw["backends"]:
                if name not in REGISTRY:
                    raise ValueError(f"unknown benchmark backend {name!r}; known: {', '.join(REGISTRY)}")
        if "modes" in cfg:
            modes = [str(m) for m in _as_list(cfg["modes"])]
            for m in modes:
                if m not in MODES:
                    raise ValueError(f"unknown mode {m!r}; expected fwd, bwd or fwdbwd")
            kw["modes"] = [MODES[m] for m in modes]
        for key, sub in (("timing", Timing), ("check", Check), ("plots", Plots)):
            if cfg.get(key) is not None:
                values = dict(cfg[key])
                bad = set(values) - {f.name for f in dataclasses.fields(sub)}
                if bad:
                    raise ValueError(f"unknown {key} keys: {sorted(bad)}")
                if "quantiles" in values:
                    values["quantiles"] = tuple(values["quantiles"])
                kw[key] = sub(**values)
        wandb = cfg.get("wandb", (cfg.get("logger") or {}).get("wandb"))
        kw["wandb"] = dict(wandb) if wandb else None
        config = cls(**kw)
        config.shapes()  # a case with heads not a multiple of kv_heads fails here, not mid-sweep
        if config.timing.cuda_graph and config.modes != ["fwd"]:
            raise ValueError(f"timing.cuda_graph times forward calls only (modes=[fwd]); got modes={config.modes}")
        return config

    def batch_for(self, seq_len: int) -> int:
        return int(self.batch) if self.batch else max(1, int(self.tokens) // int(seq_len))

    def heads_for(self, head_dim: int) -> int:
        return int(self.heads) if self.heads else max(1, int(self.hidden) // int(head_dim))

    def shapes(self) -> list[Shape]:
        """The sweep's shapes: ``cases`` if given, else every head_dim x seq_len (square, MHA)."""
        if not self.cases:
            return [Shape(self.batch_for(s), self.heads_for(d), self.heads_for(d), s, s, d)
                    for d in self.head_dims for s in self.seq_lens]
        shapes = []
        for case in self.cases:
            q_len, head_dim = case["q_len"], case["head_dim"]
            kv_len = case.get("kv_len", q_len)
            heads = case.get("heads", self.heads_for(head_dim))
            kv_heads = case.get("kv_heads", heads)
            if heads % kv_heads:
                raise ValueError(f"case {case}: heads must be a multiple of kv_heads (GQA)")
            batch = case.get("batch", self.batch_for(max(q_len, kv_len)))
            shapes.append(Shape(batch, heads, kv_heads, q_len, kv_len, head_dim))
        return shapes

    def torch_device(self) -> torch.device:
        """``device``: auto (a GPU where there is one), cpu, cuda or cuda:N; ValueError where this machine has
        no such device."""
        if self.device in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device} but no CUDA device is available (this preset times GPU "
                             f"kernels; device=cpu runs the CPU backends)")
        return device

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["patterns"] = [{"name": p.name, "params": dict(p.params), "label": p.label, "causal": p.mask.causal,
                            "score_mod": p.score_mod and {"name": p.score_mod[0], "params": dict(p.score_mod[1])},
                            "dropout": p.dropout_p}
                           for p in self.patterns]
        return out
