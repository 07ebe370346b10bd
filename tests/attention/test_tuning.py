"""The Triton kernels' configs: tuned on request once per key and cached on disk, else looked up in
the shipped table by nearest key, else the first candidate.

The interpreter never tunes, so these tests switch it off in ``tuning`` and replace the timing
(``_tune``) with a recorder that picks the *last* candidate, which makes a tuned choice visible.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import triton

from sparseflash.attention.triton import forward_persistent, tuning
from sparseflash.masks import make


@pytest.fixture
def tunings(monkeypatch, tmp_path):
    """The candidate lists timed so far; a fresh in-memory table and disk cache."""
    monkeypatch.setenv("SPARSEFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSEFLASH_TUNE", "1")
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_table", lambda: {})
    tuning.forget()
    timed = []

    def record(launch, options):
        timed.append(list(options))
        return options[-1]

    monkeypatch.setattr(tuning, "_tune", record)
    yield timed
    tuning.forget()


def _key(seq_len: int, pattern: str = "butterfly", head_dim: int = 64) -> tuning.ConfigKey:
    q = torch.empty(1, 4, seq_len, head_dim)
    return tuning.ConfigKey.of(q, make(pattern, seq_len, block=128), head_dim)


def test_tunes_once_per_key_and_launches_the_choice(tunings):
    key, launched = _key(1024), []
    first = tuning.run_tuned("forward", key, launched.append)
    second = tuning.run_tuned("forward", key, launched.append)
    assert first == second == tuning.candidates("forward", key)[-1]
    assert launched == [first, first] and len(tunings) == 1


def test_choice_survives_the_process_on_disk(tunings, tmp_path, monkeypatch):
    key = _key(1024)
    chosen = tuning.run_tuned("backward", key, lambda cfg: None)
    stored = json.loads((tmp_path / "tuning.json").read_text())
    assert [name.split("|")[0] for name in stored] == ["backward"]
    tuning.forget()  # a new process: only the disk cache is left
    assert tuning.run_tuned("backward", key, lambda cfg: None) == chosen
    assert len(tunings) == 1


def test_a_stale_disk_entry_is_tuned_again(tunings, tmp_path):
    key = _key(1024)
    name = f"backward|{key}"
    (tmp_path / "tuning.json").write_text(json.dumps({name: dict(block_m=8, block_n=8, num_warps=1, num_stages=9)}))
    assert tuning.run_tuned("backward", key, lambda cfg: None) == tuning.candidates("backward", key)[-1]
    assert len(tunings) == 1


def test_same_bucket_reuses_a_new_length_retunes_a_new_bucket(tunings):
    assert _key(4096) == _key(4200)  # same trip-count and grid buckets: no new tuning
    tuning.run_tuned("forward", _key(4096), lambda cfg: None)
    tuning.run_tuned("forward", _key(4200), lambda cfg: None)
    assert len(tunings) == 1
    assert _key(16384).row_work != _key(1024).row_work
    tuning.run_tuned("forward", _key(16384), lambda cfg: None)
    assert len(tunings) == 2


@pytest.mark.parametrize("env", ["unset", "0"])
def test_without_a_request_nothing_is_tuned_and_the_first_candidate_runs(tunings, monkeypatch, env):
    """No table entry for this GPU: the first candidate, with no timing and nothing on disk."""
    if env == "unset":
        monkeypatch.delenv("SPARSEFLASH_TUNE")
    else:
        monkeypatch.setenv("SPARSEFLASH_TUNE", env)
    key = _key(1024, "causal")
    assert tuning.run_tuned("forward", key, lambda cfg: None) == tuning.candidates("forward", key)[0]
    assert tunings == [] and not (tuning._cache_path()).exists()


def _fits_only(*fitting: tuning.KernelConfig):
    """A launch that records its configs and runs only ``fitting`` ones (the others: out of shared memory)."""
    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg not in fitting:
            raise _out_of_resources()

    return launch, tried


def test_a_config_that_does_not_fit_gives_way_to_the_next_that_fits(tunings, monkeypatch):
    """Untuned, the first candidate out of shared memory (a variant the candidates were not ordered for): the
    next that fits runs, then on every launch; none fits: an error naming them."""
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    key = _key(1024, "causal", head_dim=256)
    options = tuning.candidates("dq", key)
    assert len(options) >= 3
    launch, tried = _fits_only(options[2])
    assert tuning.run_tuned("dq", key, launch) == options[2]
    assert tuning.run_tuned("dq", key, launch) == options[2]
    assert tried == [*options[:3], options[2]] and tunings == []
    launch, tried = _fits_only()
    with pytest.raises(RuntimeError, match="no kernel config fits this GPU"):
        tuning.run_tuned("dq", _key(4096, "causal", head_dim=256), launch)


@pytest.mark.parametrize("source", ["launched-before", "tuned", "disk-cache"])
def test_a_config_chosen_for_a_lighter_variant_of_the_key_gives_way_too(source, tunings, monkeypatch, tmp_path):
    """A key covers variants of unequal needs (a mask function, key_lengths): its config, first launched with a
    variant it fits, tuned, or found in the disk cache, gives way where a heavier variant cannot run it."""
    key = _key(1024, "causal", head_dim=256)
    options = tuning.candidates("dq", key)
    if source == "disk-cache":
        name = f"dq|{key}"
        (tmp_path / "tuning.json").write_text(json.dumps({name: dataclasses.asdict(options[0])}))
    else:
        if source == "launched-before":
            monkeypatch.delenv("SPARSEFLASH_TUNE")
        chosen = tuning.run_tuned("dq", key, lambda cfg: None)
        assert chosen == (options[0] if source == "launched-before" else options[-1])
    first = tuning.planned("dq", key)
    launch, tried = _fits_only(*[cfg for cfg in options if cfg != first])
    fallback = next(cfg for cfg in options if cfg != first)
    assert tuning.run_tuned("dq", key, launch) == fallback and tried == [first, fallback]
    assert tuning.planned("dq", key) == fallback


def test_a_score_function_whose_captures_train_has_a_backward_key_of_its_own():
    """Its backward adds the captured tensors' gradients (more shared memory): a backward config chosen for the
    same function with frozen captures must not be taken for it. The forward computes the same either way."""
    from sparseflash.attention.score_mods import make_score_mod
    from sparseflash.attention.triton.plan import LaunchPlan
    from sparseflash.masks.functions import trace

    q = torch.empty(1, 4, 256, 64)
    bias = make_score_mod("relative_bias", 4, max_distance=16)
    plans = {}
    for trained in (False, True):
        bias.table.requires_grad_(trained)
        plans[trained] = LaunchPlan.of(q, q, make("causal", 256), False, 0.125, trace(bias, "score_mod"))
    assert plans[False].config_key == plans[False].backward_key == plans[True].config_key
    assert plans[True].backward_key == dataclasses.replace(plans[True].config_key, mods="score+grads")


def test_a_pinned_config_that_does_not_fit_reports(tunings, monkeypatch):
    key = _key(1024, "causal", head_dim=256)
    pinned = tuning.candidates("dq", key)[0]
    tuning.pin("dq", key, pinned)
    launch, tried = _fits_only(*tuning.candidates("dq", key)[1:])
    with pytest.raises(triton.runtime.errors.OutOfResources):
        tuning.run_tuned("dq", key, launch)
    assert tried == [pinned]


def test_tuned_block_tunes_new_keys(tunings, monkeypatch):
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    key = _key(1024)
    with tuning.tuned():
        assert tuning.run_tuned("forward", key, lambda cfg: None) == tuning.candidates("forward", key)[-1]
    assert len(tunings) == 1
    tuning.run_tuned("forward", _key(16384), lambda cfg: None)  # outside the block: not tuned
    assert len(tunings) == 1


def _table_of(*entries):
    """A shipped table holding ``(kernel, key, config)`` entries."""
    table = {}
    for kernel, key, cfg in entries:
        table.setdefault(key.device, []).append((kernel, key, cfg))
    return lambda: table


def test_the_table_gives_the_nearest_keys_config(tunings, monkeypatch):
    """Without a request to tune, the table's entry for the nearest key of the same kernel: the same
    bucket of work before another, the same mask kind before another; another GPU's never."""
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    short, long_ = _key(1024), _key(16384)
    first, second, third = tuning.candidates("forward", short)[1:4]
    on_another_gpu = tuning.ConfigKey(**{**vars(long_), "device": "another GPU"})
    monkeypatch.setattr(tuning, "_table", _table_of(("forward", short, first), ("forward", long_, second),
                                                    ("dq", long_, third), ("forward", on_another_gpu, third)))
    assert tuning.run_tuned("forward", _key(16000), lambda cfg: None) == second  # long_'s bucket
    assert tuning.run_tuned("forward", _key(1100), lambda cfg: None) == first
    causal_long = _key(16384, "causal")
    assert tuning.key_distance(causal_long, long_) < tuning.key_distance(causal_long, short)
    assert tuning.run_tuned("forward", causal_long, lambda cfg: None) == second
    assert tunings == []


def test_a_gpu_the_table_lacks_takes_the_entries_of_its_architecture(tunings, monkeypatch):
    """A GPU without entries of its own (an H200) takes those of the table's GPU of the same compute
    capability, the nearest in multiprocessors where several have it; a GPU with entries of its own
    takes those, even where another table GPU is nearer in multiprocessors; a GPU of another capability,
    or one this machine does not have, takes the first candidate."""
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    key = _key(4096)
    options = tuning.candidates("forward", key)
    sxm, pcie = (dataclasses.replace(key, device=name) for name in ("H100 SXM", "H100 PCIe"))
    monkeypatch.setattr(tuning, "_table", _table_of(("forward", sxm, options[2]), ("forward", pcie, options[3])))
    monkeypatch.setattr(tuning, "_table_gpus", lambda: {"H100 SXM": {"capability": "9.0", "multiprocessors": 132},
                                                        "H100 PCIe": {"capability": "9.0", "multiprocessors": 114}})
    here = {"H200": {"capability": "9.0", "multiprocessors": 132},
            "H100 NVL": {"capability": "9.0", "multiprocessors": 112},
            "H100 PCIe": {"capability": "9.0", "multiprocessors": 132},  # nearer the SXM's, yet its own entries
            "A100": {"capability": "8.0", "multiprocessors": 108}}
    monkeypatch.setattr(tuning, "_architecture_named", here.get)
    for device, expected in [("H200", options[2]), ("H100 NVL", options[3]), ("H100 PCIe", options[3]),
                             ("A100", options[0]), ("not on this machine", options[0])]:
        chosen = tuning.run_tuned("forward", dataclasses.replace(key, device=device), lambda cfg: None)
        assert chosen == expected, device
    assert tunings == []


@pytest.mark.gpu
def test_this_gpu_finds_table_entries_where_the_table_knows_its_architecture():
    """The real lookup of this GPU's architecture: a GPU whose compute capability the shipped table
    records is served by it (an H200 by the H100's entries)."""
    tuning._table_file.cache_clear()
    tuning._table.cache_clear()
    name = torch.cuda.get_device_name()
    capability = tuning.architecture(torch.cuda.current_device())["capability"]
    known = {gpu["capability"] for gpu in tuning._table_gpus().values()}
    assert (tuning.table_gpu(name) is not None) == (name in tuning._table() or capability in known)


def test_a_key_without_the_persistent_forward_takes_the_nearest_regular_config(tunings, monkeypatch):
    """A ragged length leaves the persistent forward out (mode ""): the table's entries for the
    persistent-capable key still serve it, the nearest one whose config is not persistent."""
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    q = torch.empty(1, 4, 4096, 128)
    auto = tuning.ConfigKey.of(q, make("causal", 4096, block=128), 128, persistent="auto")
    ragged = tuning.ConfigKey.of(torch.empty(1, 4, 4000, 128), make("causal", 4000, block=128), 128)
    regular = tuning.candidates("forward", auto)[2]
    assert not regular.persistent and ragged.persistent == ""
    monkeypatch.setattr(tuning, "_table", _table_of(("forward", auto, tuning.PERSISTENT_FORWARD[0]),
                                                    ("forward", tuning.ConfigKey(**{**vars(auto), "row_work": 9}),
                                                     regular),
                                                    ("backward", auto, tuning.candidates("backward", auto)[3])))
    assert tuning.run_tuned("forward", ragged, lambda cfg: None) == regular
    assert tuning.run_tuned("backward", ragged, lambda cfg: None) == tuning.candidates("backward", ragged)[3]


def test_a_table_entry_that_is_no_candidate_is_passed_over(tunings, monkeypatch):
    """A config the key's candidates lack (an older table's, or another head dim's) is not launched."""
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    key = _key(1024)
    stranger = tuning.KernelConfig(16, 16, 1, 1)
    other_dim = _key(1024, head_dim=128)
    monkeypatch.setattr(tuning, "_table", _table_of(("forward", key, stranger),
                                                    ("forward", other_dim, tuning.candidates("forward", key)[2])))
    assert tuning.run_tuned("forward", key, lambda cfg: None) == tuning.candidates("forward", key)[0]


def test_a_split_head_dim_takes_its_own_candidates_and_no_padded_entry(tunings, monkeypatch):
    """Head_dim 96 (64 + 32 columns) takes the candidate lists of 96 columns and passes over the table's
    head_dim-128 entries, tuned for other kernels."""
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    from sparseflash.attention.triton.plan import LaunchPlan

    q = torch.empty(1, 4, 1024, 96)
    key = LaunchPlan.of(q, q, make("causal", 1024, block=128), False, 96 ** -0.5).config_key
    assert key.head_dim_parts == "64+32" and key.columns == 96 and key.head_dim == 128
    assert tuning.candidates("forward", key) == tuning.CANDIDATES["forward"][96]
    assert tuning.candidates("backward", key) == tuning.CANDIDATES["backward"][96]
    padded = dataclasses.replace(key, head_dim_parts="")
    # disk-cache names carry the parts where set, and no empty field for an unsplit key
    assert "|64+32|" in str(key) and str(padded).count("|") == str(key).count("|") - 1
    forward_entry, backward_entry = tuning.KernelConfig(128, 64, 4, 2), tuning.KernelConfig(128, 64, 8, 2)
    assert forward_entry in tuning.CANDIDATES["forward"][96] and backward_entry in tuning.CANDIDATES["backward"][96]
    monkeypatch.setattr(tuning, "_table", _table_of(("forward", padded, forward_entry),
                                                    ("backward", padded, backward_entry)))
    assert tuning.run_tuned("forward", key, lambda cfg: None) == tuning.CANDIDATES["forward"][96][0]
    assert tuning.run_tuned("backward", key, lambda cfg: None) == tuning.CANDIDATES["backward"][96][0]
    assert tuning.run_tuned("backward", padded, lambda cfg: None) == backward_entry


def test_the_shipped_table_reads_and_its_configs_are_candidates(monkeypatch):
    """config_table.json parses, and each entry is a candidate of its own key (a table written for
    other candidate lists would silently fall back to the first candidate)."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    tuning._table_file.cache_clear()
    tuning._table.cache_clear()
    entries = [entry for gpu in tuning._table().values() for entry in gpu]
    assert entries, "the shipped table is empty"
    for name in tuning._table():  # what a GPU without entries of its own is matched by (``table_gpu``)
        assert {"capability", "multiprocessors"} <= tuning._table_gpus()[name].keys(), name
    for kernel, key, cfg in entries:
        assert cfg in tuning.candidates(kernel, key), (kernel, str(key), str(cfg))


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_candidates_divide_the_mask_blocks(head_dim, monkeypatch):
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    q = torch.empty(1, 2, 300, head_dim)
    key = tuning.ConfigKey.of(q, make("random", 300, block=(32, 64), density=0.5), head_dim)
    options = {kernel: tuning.candidates(kernel, key) for kernel in tuning.CANDIDATES}
    for found in options.values():
        assert found and len(set(found)) == len(found)
    # the mask-block sides that the held and the streamed tile must divide: dkdv holds keys and
    # streams queries; backward holds and streams both, so its tiles divide both sides
    sides = {"forward": (32, 64), "dq": (32, 64), "dkdv": (64, 32), "backward": (32, 32)}
    for kernel, (held_side, streamed_side) in sides.items():
        assert all(held_side % c.block_m == 0 and streamed_side % c.block_n == 0 for c in options[kernel]), kernel


def _out_of_resources():
    return triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")


def _scripted_bench(monkeypatch, script):
    """Replace do_bench: the n-th timing of a config returns ``script[config][n - 1]`` (its calls'
    times; an exception is raised). Returns the launch function to tune with, the configs in the
    order they were timed and the ``rep`` (ms) each timing was given."""
    import triton.testing

    launched, timed, reps = [], [], []

    def bench(fn, **kwargs):
        fn()
        cfg = launched[-1]
        timed.append(cfg)
        reps.append(kwargs["rep"])
        result = script[cfg][timed.count(cfg) - 1]
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    return launched.append, timed, reps


def test_tune_drops_slow_and_unfitting_configs_then_takes_turns(monkeypatch):
    a, b, c, d = (tuning.KernelConfig(m, 64, 4, 2) for m in (16, 32, 64, 128))
    # first round: c does not fit, d is over SLOWER_THAN_BEST x the fastest (a); then a and b take
    # turns for TUNING_ROUNDS rounds, and b's median is the lower one although a led the first round
    launch, timed, reps = _scripted_bench(monkeypatch, {
        a: [[3.0], [3.4, 3.4], [3.3], [3.4], [3.5]],
        b: [[3.3], [3.2], [3.2, 3.1], [3.2], [3.3]],
        c: [_out_of_resources()],
        d: [[9.0]],
    })
    assert tuning._tune(launch, [a, b, c, d]) == b
    assert tuning.TUNING_ROUNDS == 4
    assert timed == [a, b, c, d] + [a, b, b, a, a, b, b, a]
    # the rounds last ROUND_CALLS calls of the fastest (3.0 ms), more than ROUND_MS
    assert reps == [tuning.FIRST_ROUND_MS] * 4 + [tuning.ROUND_CALLS * 3.0] * 8


@pytest.mark.parametrize("fastest_ms, want", [(0.2, tuning.ROUND_MS), (3.0, tuning.ROUND_CALLS * 3.0),
                                               (50.0, tuning.MAX_ROUND_MS)],
                         ids=["short-kernel-ROUND_MS", "ms-kernel-ROUND_CALLS", "long-kernel-MAX_ROUND_MS"])
def test_tuning_rounds_grow_with_the_kernel_up_to_a_cap(fastest_ms, want):
    assert tuning.round_ms(fastest_ms) == pytest.approx(want)
    assert tuning.ROUND_MS <= tuning.round_ms(fastest_ms) <= tuning.MAX_ROUND_MS


def test_tune_keeps_a_lone_survivor_without_more_rounds(monkeypatch):
    a, b = tuning.KernelConfig(64, 64, 4, 2), tuning.KernelConfig(128, 64, 8, 3)
    launch, timed, _ = _scripted_bench(monkeypatch, {a: [[2.0, 2.1]], b: [[5.0]]})
    assert tuning._tune(launch, [a, b]) == a
    assert timed == [a, b]


def test_tune_says_when_no_config_fits(monkeypatch):
    a = tuning.KernelConfig(64, 64, 4, 2)
    launch, _, _ = _scripted_bench(monkeypatch, {a: [_out_of_resources()]})
    with pytest.raises(RuntimeError, match="no kernel config fits"):
        tuning._tune(launch, [a])


@pytest.mark.parametrize("mode", ["", "auto", "only"], ids=["never", "auto", "only"])
def test_persistent_forward_candidates(mode, monkeypatch):
    """Where forward_persistent.mode allows the persistent forward, "auto" tunes it against the other
    forward configs, "only" tries it alone, "" leaves it out; no other kernel gets it."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    q = torch.empty(1, 4, 4096, 128)
    key = tuning.ConfigKey.of(q, make("butterfly", 4096, block=128), 128, persistent=mode)
    found = tuning.candidates("forward", key)
    persistent = [c for c in found if c.persistent]
    assert persistent == {"": [], "auto": tuning.PERSISTENT_FORWARD, "only": tuning.PERSISTENT_FORWARD}[mode]
    others = len(tuning.CANDIDATES["forward"][128])
    assert len(found) - len(persistent) == {"": others, "auto": others, "only": 0}[mode]
    assert not any(c.persistent for c in tuning.candidates("backward", key))


@pytest.mark.parametrize("choice, interpreter, want", [("0", False, ""), ("auto", False, "auto"), ("1", False, "only"),
                                                        ("auto", True, ""), ("1", True, "only")],
                         ids=["0", "auto", "1", "auto-interpreter", "1-interpreter"])
def test_persistent_mode_follows_the_environment(choice, interpreter, want, monkeypatch):
    """SPARSEFLASH_PERSISTENT on a problem the persistent forward takes (fp16, 128-divisible lengths,
    head_dim 128): "auto" leaves the choice to the table or the tuner (the interpreter has neither), "1" forces it."""
    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", choice)
    monkeypatch.setattr(forward_persistent, "interpreting", lambda: interpreter)
    monkeypatch.setattr(forward_persistent, "_supported", lambda device: True)
    q = torch.empty(1, 4, 4096, 128, dtype=torch.float16)
    assert forward_persistent.mode(q, q, make("butterfly", 4096, block=128), False, 128) == want


@pytest.mark.parametrize("case", ["key_lengths", "padded-head-dim", "ragged-length", "ragged-sparse", "fp32"])
def test_persistent_mode_refuses_what_it_cannot_take(case, monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "1")
    monkeypatch.setattr(forward_persistent, "_supported", lambda device: True)
    seq_len = 4000 if case in ("ragged-length", "ragged-sparse") else 4096
    dim = 96 if case == "padded-head-dim" else 128
    q = torch.empty(1, 4, seq_len, dim, dtype=torch.float32 if case == "fp32" else torch.float16)
    mask = make("butterfly" if case != "ragged-length" else "dense", seq_len, block=128)
    padded = 128
    assert forward_persistent.mode(q, q, mask, case == "key_lengths", padded) == ""


def test_persistent_choice_rejects_other_values(monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "yes")
    with pytest.raises(ValueError, match="SPARSEFLASH_PERSISTENT must be auto, 0 or 1; got 'yes'"):
        forward_persistent.mode(torch.empty(1, 1, 128, 16), torch.empty(1, 1, 128, 16), make("dense", 128), False, 16)


def test_table_entries_keep_the_config_most_passes_chose():
    """Three tuning passes: per key the majority config, the earliest pass's on a tie, a pass's last
    launch of a key standing for that pass."""
    key, other = _key(1024), _key(16384)
    a, b, c = tuning.KernelConfig(64, 64, 4, 2), tuning.KernelConfig(128, 64, 8, 3), tuning.KernelConfig(64, 32, 4, 2)

    def launched(*entries):
        return [tuning.Launched(kernel, k, cfg, lambda cfg: None) for kernel, k, cfg in entries]

    passes = [launched(("backward", key, c), ("backward", key, a), ("backward", other, a)),  # a (its last)
              launched(("backward", key, b), ("backward", other, b)),
              launched(("backward", key, b), ("backward", other, c))]
    entries = {(e["kernel"], e["key"]["row_work"]): tuning.KernelConfig(**e["config"])
               for e in tuning.table_entries(*passes)}
    assert entries == {("backward", key.row_work): b, ("backward", other.row_work): a}
    single = tuning.table_entries(passes[0])
    assert [tuning.KernelConfig(**e["config"]) for e in single] == [a, a]


def test_the_public_tuned_block_asks_for_tuning(monkeypatch):
    import sparseflash

    monkeypatch.delenv("SPARSEFLASH_TUNE", raising=False)
    assert not tuning.tuning_requested()
    with sparseflash.tuned():
        assert tuning.tuning_requested()
    assert not tuning.tuning_requested()


def test_the_choices_version_counts_tunes_and_changes_not_first_choices(tunings, monkeypatch):
    """What replay.py records a call again after: a tune, a fallback, a changed pin, ``forget``; not a key's first
    choice (a decoding loop meets a new key at each length), nor the same choice again. None while a recording
    block is open."""
    version = tuning.choices_version
    start = version()
    tuning.run_tuned("forward", _key(1024), lambda cfg: None)  # tuned (SPARSEFLASH_TUNE=1)
    assert version() > start
    monkeypatch.delenv("SPARSEFLASH_TUNE")
    unchanged = version()
    tuning.run_tuned("forward", _key(16384), lambda cfg: None)  # a first choice: the first candidate
    tuning.run_tuned("forward", _key(1024), lambda cfg: None)  # the same choice again
    first = tuning.candidates("forward", _key(1024))[0]
    tuning.pin("backward", _key(1024), first)  # a first choice, pinned
    tuning.pin("backward", _key(1024), first)
    assert version() == unchanged
    changes = [lambda: tuning.pin("backward", _key(1024), tuning.candidates("backward", _key(1024))[1]),
               lambda: tuning.run_tuned("dq", _key(1024, "causal", head_dim=256),
                                        _fits_only(tuning.candidates("dq", _key(1024, "causal", head_dim=256))[1])[0]),
               tuning.forget]
    for change in changes:
        before = version()
        change()
        assert version() > before
    with tuning.recording():
        assert version() is None
