"""The tuned-config table of the Triton kernels: tune once per key, cache on disk, bucket by work.

The interpreter never tunes, so these tests switch it off in ``configs`` and replace the timing
(``_tune``) with a recorder that picks the *last* candidate, which makes a tuned choice visible.
"""

from __future__ import annotations

import json

import pytest
import torch

from sparseflash.attention.triton import configs
from sparseflash.masks import make


@pytest.fixture
def tunings(monkeypatch, tmp_path):
    """The candidate lists timed so far; a fresh in-memory table and disk cache."""
    monkeypatch.setenv("SPARSEFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SPARSEFLASH_TUNE", raising=False)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_chosen", {})
    timed = []

    def record(launch, options):
        timed.append(list(options))
        return options[-1]

    monkeypatch.setattr(configs, "_tune", record)
    return timed


def _key(seq_len: int, pattern: str = "butterfly", head_dim: int = 64) -> configs.ConfigKey:
    q = torch.empty(1, 4, seq_len, head_dim)
    return configs.ConfigKey.of(q, make(pattern, seq_len, block=128), head_dim)


def test_tunes_once_per_key_and_launches_the_choice(tunings):
    key, launched = _key(1024), []
    first = configs.run_tuned("forward", key, launched.append)
    second = configs.run_tuned("forward", key, launched.append)
    assert first == second == configs.candidates("forward", key)[-1]
    assert launched == [first, first] and len(tunings) == 1


def test_choice_survives_the_process_on_disk(tunings, tmp_path, monkeypatch):
    key = _key(1024)
    chosen = configs.run_tuned("backward", key, lambda cfg: None)
    stored = json.loads((tmp_path / "tuning.json").read_text())
    assert [name.split("|")[0] for name in stored] == ["backward"]
    monkeypatch.setattr(configs, "_chosen", {})  # a new process: only the disk cache is left
    assert configs.run_tuned("backward", key, lambda cfg: None) == chosen
    assert len(tunings) == 1


def test_a_stale_disk_entry_is_tuned_again(tunings, tmp_path):
    key = _key(1024)
    name = f"backward|{key}"
    (tmp_path / "tuning.json").write_text(json.dumps({name: dict(block_m=8, block_n=8, num_warps=1, num_stages=9)}))
    assert configs.run_tuned("backward", key, lambda cfg: None) == configs.candidates("backward", key)[-1]
    assert len(tunings) == 1


def test_same_bucket_reuses_a_new_length_retunes_a_new_bucket(tunings):
    assert _key(4096) == _key(4200)  # same trip-count and grid buckets: no new tuning
    configs.run_tuned("forward", _key(4096), lambda cfg: None)
    configs.run_tuned("forward", _key(4200), lambda cfg: None)
    assert len(tunings) == 1
    assert _key(16384).row_work != _key(1024).row_work
    configs.run_tuned("forward", _key(16384), lambda cfg: None)
    assert len(tunings) == 2


def test_tuning_off_takes_the_first_candidate(tunings, monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_TUNE", "0")
    key = _key(1024, "causal")
    assert configs.run_tuned("forward", key, lambda cfg: None) == configs.candidates("forward", key)[0]
    assert tunings == []


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_candidates_divide_the_mask_blocks(head_dim, monkeypatch):
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    q = torch.empty(1, 2, 300, head_dim)
    key = configs.ConfigKey.of(q, make("random", 300, block=(32, 64), density=0.5), head_dim)
    options = {kernel: configs.candidates(kernel, key) for kernel in configs.CANDIDATES}
    for found in options.values():
        assert found and len(set(found)) == len(found)
    # the mask-block sides that the held and the streamed tile must divide: dkdv holds keys and
    # streams queries; backward holds and streams both, so its tiles divide both sides
    sides = {"forward": (32, 64), "dq": (32, 64), "dkdv": (64, 32), "backward": (32, 32)}
    for kernel, (held_side, streamed_side) in sides.items():
        assert all(held_side % c.block_m == 0 and streamed_side % c.block_n == 0 for c in options[kernel]), kernel


def _out_of_resources():
    import triton

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
    a, b, c, d = (configs.KernelConfig(m, 64, 4, 2) for m in (16, 32, 64, 128))
    # first round: c does not fit, d is over SLOWER_THAN_BEST x the fastest (a); then a and b take
    # turns for TUNING_ROUNDS rounds, and b's median is the lower one although a led the first round
    launch, timed, reps = _scripted_bench(monkeypatch, {
        a: [[3.0], [3.4, 3.4], [3.3], [3.4], [3.5]],
        b: [[3.3], [3.2], [3.2, 3.1], [3.2], [3.3]],
        c: [_out_of_resources()],
        d: [[9.0]],
    })
    assert configs._tune(launch, [a, b, c, d]) == b
    assert configs.TUNING_ROUNDS == 4
    assert timed == [a, b, c, d] + [a, b, b, a, a, b, b, a]
    # the rounds last ROUND_CALLS calls of the fastest (3.0 ms), more than ROUND_MS
    assert reps == [configs.FIRST_ROUND_MS] * 4 + [configs.ROUND_CALLS * 3.0] * 8


@pytest.mark.parametrize("fastest_ms, want", [(0.2, configs.ROUND_MS), (3.0, configs.ROUND_CALLS * 3.0),
                                               (50.0, configs.MAX_ROUND_MS)],
                         ids=["short-kernel-ROUND_MS", "ms-kernel-ROUND_CALLS", "long-kernel-MAX_ROUND_MS"])
def test_tuning_rounds_grow_with_the_kernel_up_to_a_cap(fastest_ms, want):
    assert configs.round_ms(fastest_ms) == pytest.approx(want)
    assert configs.ROUND_MS <= configs.round_ms(fastest_ms) <= configs.MAX_ROUND_MS


def test_tune_keeps_a_lone_survivor_without_more_rounds(monkeypatch):
    a, b = configs.KernelConfig(64, 64, 4, 2), configs.KernelConfig(128, 64, 8, 3)
    launch, timed, _ = _scripted_bench(monkeypatch, {a: [[2.0, 2.1]], b: [[5.0]]})
    assert configs._tune(launch, [a, b]) == a
    assert timed == [a, b]


def test_tune_says_when_no_config_fits(monkeypatch):
    a = configs.KernelConfig(64, 64, 4, 2)
    launch, _, _ = _scripted_bench(monkeypatch, {a: [_out_of_resources()]})
    with pytest.raises(RuntimeError, match="no kernel config fits"):
        configs._tune(launch, [a])


@pytest.mark.parametrize("choice", ["0", "auto", "1"])
def test_persistent_forward_candidates(choice, monkeypatch):
    """SPARSEFLASH_PERSISTENT: where the key allows the persistent forward, "auto" tunes it against the
    other forward configs, "1" tries it alone and "0" leaves it out; no other kernel gets it."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", choice)
    q = torch.empty(1, 4, 4096, 128)
    key = configs.ConfigKey.of(q, make("butterfly", 4096, block=128), 128, persistent=True)
    found = configs.candidates("forward", key)
    persistent = [c for c in found if c.persistent]
    assert persistent == {"0": [], "auto": configs.PERSISTENT_FORWARD, "1": configs.PERSISTENT_FORWARD}[choice]
    others = len(configs.CANDIDATES["forward"][128])
    assert len(found) - len(persistent) == {"0": others, "auto": others, "1": 0}[choice]
    assert not any(c.persistent for c in configs.candidates("backward", key))
    not_allowed = configs.ConfigKey.of(q, make("butterfly", 4096, block=128), 128)
    assert not any(c.persistent for c in configs.candidates("forward", not_allowed))


def test_persistent_choice_rejects_other_values(monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "yes")
    with pytest.raises(ValueError, match="SPARSEFLASH_PERSISTENT must be auto, 0 or 1; got 'yes'"):
        configs.persistent_choice()
