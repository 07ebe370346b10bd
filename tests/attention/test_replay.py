"""``Replay``: a settled call's launches launched again on a later call's tensors.

No GPU here for the first tests: ``launch.Compiled`` wraps test_launch.py's recording compiled kernel, whose
launcher logs what it is given. The GPU test runs calls through ``sparseflash.attention`` again and again on fresh
inputs of several layouts, each against the reference, and checks that replays ran.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparseflash.attention.triton import launch, replay, tuning
from tests.attention.test_launch import STREAM, RecordingCompiled
from tests.helpers import SeededDropout, check_backend

CONSTEXPRS = (32, True)


@pytest.fixture
def log(monkeypatch):
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: STREAM)
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=active))
    return []


def _recorded(log, *launches):
    """``recorded`` launches of two kernels: (kernel index, grid, tensors, scalars) each."""
    kernels = [launch.Compiled(RecordingCompiled(log), CONSTEXPRS) for _ in range(2)]
    return [(kernels[i], grid, tensors, scalars) for i, grid, tensors, scalars in launches]


def _tensors(n):
    return tuple(torch.randn(64) for _ in range(n))


def test_a_replay_launches_the_recorded_kernels_on_a_later_calls_tensors(log):
    (table,), (a, b, out) = _tensors(1), _tensors(3)
    kept = replay.Replay.of(_recorded(log, (0, (3, 2), (a, table, out), (64, 0.5)), (1, (5,), (out, b), (1,))),
                            (a, b, out), (table,))
    a2, b2, out2 = _tensors(3)
    assert kept((a2, b2, out2))
    assert log == [("direct", (3, 2, 1), (a2.data_ptr(), table.data_ptr(), out2.data_ptr(), 64, 0.5, *CONSTEXPRS)),
                   ("direct", (5, 1, 1), (out2.data_ptr(), b2.data_ptr(), 1, *CONSTEXPRS))]


def test_a_replay_launches_nothing_for_a_misaligned_tensor_on_another_device_or_with_launch_hooks_set(log):
    import triton

    a, out = _tensors(2)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, out), ())), (a, out), ())
    padded = torch.randn(65)
    assert not kept((padded[1:], out))
    launch.driver.active.get_current_device = lambda: 1  # another GPU made the current one
    assert not kept((a, out))
    launch.driver.active.get_current_device = lambda: 0
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert not kept((a, out))
    finally:
        triton.knobs.runtime.launch_exit_hook.remove(hook)
    assert log == []


def test_a_tma_descriptor_is_rebuilt_over_the_later_calls_tensor(log):
    """A Gluon kernel's TMA descriptor over a slot (or a plan's tensor) reads the later call's tensor, with the
    recorded shape, strides, box and layout, one object wherever the recorded call passed one; the recorded one stays
    as it was, and the replay does not keep the recorded call's tensor alive. The replay keeps the call's outcome."""
    import gc
    import weakref

    from sparseflash.attention.triton.gluon_tools import TensorDescriptor, shared_layout

    def over(x):
        return TensorDescriptor(x, [8, 8], [8, 1], [8, 8], shared_layout(8, 8, torch.float32))

    table, a, out = (torch.randn(8, 8) for _ in range(3))
    over_a, over_table = over(a), over(table)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (over_a, over_table, out, over_a), (7,))), (a, out), (table,),
                            outcome="gluon")
    a2, out2 = torch.randn(8, 8), torch.randn(8, 8)
    assert kept((a2, out2)) and kept.outcome == "gluon"
    ((kind, grid, arguments),) = log
    assert grid == (3, 1, 1) and arguments[2] == out2.data_ptr() and arguments[4:] == (7, *CONSTEXPRS)
    assert arguments[0] is arguments[3] and arguments[0].base is a2 and arguments[1].base is table
    for rebuilt, recorded in ((arguments[0], over_a), (arguments[1], over_table)):
        assert (rebuilt.shape, rebuilt.strides, rebuilt.block_shape, rebuilt.layout) == (
            recorded.shape, recorded.strides, recorded.block_shape, recorded.layout)
    assert over_a.base is a and over_table.base is table
    kept_a = weakref.ref(a)
    del a, over_a
    gc.collect()
    assert kept_a() is None  # (the replay holds the plan's table, not the call's tensors)


def test_a_plans_tensor_given_in_a_slot_stays_a_constant(log):
    """The placeholder of absent key lengths is a slot of every call of such a plan, and one of its tensors."""
    (placeholder,), (a, out) = _tensors(1), _tensors(2)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, placeholder, out), ())), (a, placeholder, out),
                            (placeholder,))
    a2, out2 = _tensors(2)
    assert kept((a2, placeholder, out2))
    assert log == [("direct", (3, 1, 1), (a2.data_ptr(), placeholder.data_ptr(), out2.data_ptr(), *CONSTEXPRS))]


@pytest.mark.parametrize("case", ["copy", "interpreter", "nothing", "aliased", "misaligned"])
def test_what_a_replay_cannot_take(case, log):
    a, out, copy = _tensors(3)
    misaligned = torch.randn(65)[1:]
    slots = {"aliased": (a, a, out), "misaligned": (misaligned, out)}.get(case, (a, out))
    launches = {"copy": _recorded(log, (0, (3,), (a, copy, out), ())),  # a tensor made on the call
                "interpreter": [None],
                "nothing": []}.get(case, _recorded(log, (0, (3,), slots, ())))
    kept = replay.Replay.of(launches, slots, ())
    # never for this layout, or not from this call: a later call may pass q and k apart, or aligned
    assert kept is (None if case in ("aliased", "misaligned") else replay.NOT_REPLAYED)


@pytest.fixture
def graphs(log, monkeypatch):
    """CUDA graph captures as fakes: a capture logs nothing and keeps the launches it saw; the graph's launch logs
    ("graph", those launches). Returns the captures made."""
    captured = []

    def fake_captured(launch_on, device):
        start = len(log)
        launch_on(STREAM)
        launches = tuple(log[start:])
        del log[start:]
        captured.append(launches)
        return SimpleNamespace(replay=lambda: log.append(("graph", launches)))

    monkeypatch.setattr(replay, "_captured", fake_captured)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return captured


def test_a_replay_launches_a_graph_on_the_addresses_of_a_call_seen_before(log, graphs):
    """The first call on some tensors launches one by one; the second on tensors at the same addresses captures
    their launches as a graph and launches it; later ones launch the graph; tensors elsewhere launch one by one."""
    (table,), (a, b, out) = _tensors(1), _tensors(3)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, table, out), (64,)), (1, (5,), (out, b), ())),
                            (a, b, out), (table,))
    one_by_one = [("direct", (3, 1, 1), (a.data_ptr(), table.data_ptr(), out.data_ptr(), 64, *CONSTEXPRS)),
                  ("direct", (5, 1, 1), (out.data_ptr(), b.data_ptr(), *CONSTEXPRS))]
    assert kept((a, b, out)) and log == one_by_one
    log.clear()
    assert kept((a, b, out)) and kept((a, b, out))
    assert graphs == [tuple(one_by_one)] and log == [("graph", tuple(one_by_one))] * 2
    log.clear()
    a2 = torch.randn(64)
    assert kept((a2, b, out)) and [entry[0] for entry in log] == ["direct", "direct"]


def test_a_graph_reads_copied_slots_from_the_replays_buffers(log, graphs):
    """The last ``copied`` slots (key lengths, a seed) do not enter a graph's key: calls with them at new addresses
    launch the graph captured on the second call, which reads them from the replay's buffers (made with it), each
    launch copying the call's values there first. A copied slot that holds a plan's tensor stays a constant."""
    (placeholder,), (a, out) = _tensors(1), _tensors(2)
    lengths = [torch.randint(0, 64, (4,), dtype=torch.int32) for _ in range(4)]  # (each at its own address)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, out, lengths[0], placeholder), ())),
                            (a, out, lengths[0], placeholder), (placeholder,), copied=2)
    [(slot, buffer)] = kept._copied
    assert slot == 2 and buffer.data_ptr() not in {x.data_ptr() for x in lengths}
    assert kept((a, out, lengths[0], placeholder)) and [entry[0] for entry in log] == ["direct"]
    log.clear()
    for x in lengths[1:]:
        assert kept((a, out, x, placeholder)) and torch.equal(buffer, x)
    read = (a.data_ptr(), out.data_ptr(), buffer.data_ptr(), placeholder.data_ptr(), *CONSTEXPRS)
    assert graphs == [(("direct", (3, 1, 1), read),)] and log == [("graph", graphs[0])] * 3


def test_a_replay_launches_one_by_one_inside_a_callers_capture(log, graphs, monkeypatch):
    """Where the caller captures a graph of its own (torch.compile's reduce-overhead), the launches go into it."""
    a, out = _tensors(2)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, out), ())), (a, out), ())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for _ in range(3):
        assert kept((a, out))
    assert graphs == [] and [entry[0] for entry in log] == ["direct"] * 3


def test_a_call_kept_inside_a_callers_capture_makes_no_buffer(log, monkeypatch):
    """A call that settles inside the caller's capture (torch.compile's reduce-overhead) is kept where no copied
    slot holds a tensor of the call (nothing is made for it), and not where one does: the buffers cannot be made
    there (on a GPU ``made_outside_graph_pools`` raises inside a capture), so a later call keeps it."""
    def refused(make, device):
        raise RuntimeError("made inside a capture")

    monkeypatch.setattr(replay, "made_outside_graph_pools", refused)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    (placeholder,), (a, out) = _tensors(1), _tensors(2)
    lengths = torch.randint(0, 64, (4,), dtype=torch.int32)
    without = (a, out, placeholder)
    assert isinstance(replay.Replay.of(_recorded(log, (0, (3,), without, ())), without, (placeholder,), copied=1),
                      replay.Replay)
    with_lengths = (a, out, lengths)
    assert replay.Replay.of(_recorded(log, (0, (3,), with_lengths, ())), with_lengths, (placeholder,), copied=1) is None


def test_a_replay_keeps_its_latest_graphs(log, graphs, monkeypatch):
    """At most GRAPHS_KEPT graphs: the least recently launched is dropped (its tensors' next calls are seen anew)."""
    monkeypatch.setattr(replay, "GRAPHS_KEPT", 2)
    out = torch.randn(64)
    a, b, c = _tensors(3)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, out), ())), (a, out), ())
    for x in (a, b, a, b, a, c, c):  # a and b captured, a launched again (b the least recent), c captured: b dropped
        assert kept((x, out))
    assert len(graphs) == 3 and [entry[0] for entry in log] == ["direct", "direct", "graph", "graph", "graph",
                                                                 "direct", "graph"]
    log.clear()
    for x in (a, b):
        assert kept((x, out))
    assert [entry[0] for entry in log] == ["graph", "direct"] and len(graphs) == 3


def test_a_replay_stops_capturing_where_its_graphs_are_not_launched_again(log, graphs, monkeypatch):
    """A replay whose captures reach twice GRAPHS_KEPT while its graphs were launched again fewer times than it
    captured stops capturing: a model's layers cycling over more address tuples than it keeps would capture on
    every other call."""
    monkeypatch.setattr(replay, "GRAPHS_KEPT", 1)
    out = torch.randn(64)
    tensors = _tensors(3)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (tensors[0], out), ())), (tensors[0], out), ())
    for a in tensors * 2:  # each seen, then each captured, dropping the one before: none launched again
        assert kept((a, out))
    assert len(graphs) == 2  # the third capture was not made
    log.clear()
    for a in tensors * 2:
        assert kept((a, out))
    assert len(graphs) == 2 and [entry[0] for entry in log] == ["direct"] * 6


def test_a_replay_whose_capture_fails_launches_one_by_one(log, monkeypatch):
    """A failed capture is tried once: the replay warns and launches one by one from then on."""
    a, out = _tensors(2)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, out), ())), (a, out), ())
    attempts = []

    def failing(launch_on, device):
        attempts.append(device)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(replay, "_captured", failing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.warns(RuntimeWarning, match="one by one"):
        for _ in range(4):
            assert kept((a, out))
    assert attempts == [0] and [entry[0] for entry in log] == ["direct"] * 4


def test_graph_replays_can_be_turned_off(log, graphs, monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_GRAPH_REPLAYS", "0")
    a, out = _tensors(2)
    kept = replay.Replay.of(_recorded(log, (0, (3,), (a, out), ())), (a, out), ())
    for _ in range(3):
        assert kept((a, out))
    assert graphs == [] and [entry[0] for entry in log] == ["direct"] * 3


def _keep(replays, key, log, settled=True, during=lambda: None):
    a, out = _tensors(2)
    with replays.keep(key, (a, out), ()) as done:
        launch._recordings.launches.extend(_recorded(log, (0, (3,), (a, out), ())))  # (as a Launcher appends)
        during()
        done[0] = settled


@pytest.fixture
def choices():
    """This process's tuning choices, dropped after the test (it pins stand-in keys)."""
    yield
    tuning.forget()


def test_replays_keep_a_settled_block_until_a_choice_changes(log, choices):
    replays = replay.Replays()
    tuning.pin("replay-test", "key", "a cfg")
    _keep(replays, "unsettled", log, settled=False)
    _keep(replays, "changed", log, during=lambda: tuning.pin("replay-test", "key", "another cfg"))
    _keep(replays, "kept", log)
    assert replays.get("unsettled") is None and replays.get("changed") is None
    tuning.pin("replay-test", "a new key", "a cfg")  # a first choice changes no kept call
    assert isinstance(replays.get("kept"), replay.Replay)
    tuning.pin("replay-test", "key", "a cfg")
    assert replays.get("kept") is None  # recorded again by the next call


def test_no_replay_while_a_tuning_recording_is_open(log):
    replays = replay.Replays()
    _keep(replays, "kept", log)
    with tuning.recording():
        assert replays.get("kept") is None
        with replays.keep("other", (), ()) as settled:
            assert getattr(launch._recordings, "launches", None) is None  # nothing recorded
            settled[0] = True
    assert replays.get("other") is None and isinstance(replays.get("kept"), replay.Replay)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal-d64-s300", "butterfly-d64-s300-keylen", "dense-d128-s256",
                                  "causal-d96-s300-dropout", "causal-d64-s300-alibi", "causal-d64-s300-relbias",
                                  "causal-d128-s1024-gluon", "dense-d64-s512-gluon"])
def test_gpu_replayed_calls_match_the_reference(case, monkeypatch):
    """Calls of one mask and shape, each on fresh inputs, in layouts that change (contiguous, strided, misaligned,
    with a gradient of lse), each forward and backward against the reference; replays must have run. Short rows:
    the Triton backward; at d128 dense S=256, the persistent forward (global scratch); with "gluon", the Gluon
    kernels (TMA descriptors rebuilt on each replay; the misaligned layout runs the Triton kernels)."""
    import sparseflash
    from sparseflash.attention.score_mods import make_score_mod
    from sparseflash.masks import make

    pattern, dim, seq = case.split("-")[0], int(case.split("-")[1][1:]), int(case.split("-")[2][1:])
    batch, heads = 2, 4
    if case.endswith("gluon"):
        if not launch.gluon_hopper(torch.device("cuda")):
            pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
        monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    mask = make(pattern, seq, block=64) if pattern == "butterfly" else pattern
    ran = []  # (slots, replayed, outcome) of each replay tried: a forward's 8 slots, a backward's 16
    replay_call = replay.Replay.__call__

    def counted(self, slots):
        ran.append((len(slots), replay_call(self, slots), self.outcome))
        return ran[-1][1]

    monkeypatch.setattr(replay.Replay, "__call__", counted)
    key_lengths = torch.tensor([seq, 123], device="cuda") if "keylen" in case else None
    # a captured tensor: ALiBi's slopes; a trained one, whose gradient the backward adds (such calls are not kept)
    score_mod = {"alibi": make_score_mod("alibi", heads),
                 "relbias": make_score_mod("relative_bias", heads, max_distance=16)}.get(case.split("-")[-1])
    if score_mod is not None:
        score_mod = score_mod.to("cuda")
        for parameter in score_mod.parameters():
            torch.nn.init.normal_(parameter, std=0.5)
    for i, layout in enumerate(["contiguous"] * 3 + ["strided", "strided", "misaligned", "contiguous", "lse"]):
        base = torch.randn(batch, seq, heads, 3 * dim + 8, dtype=torch.bfloat16, device="cuda")
        offset = 1 if layout == "misaligned" else 0
        q, k, v = (base[..., offset + j * dim:offset + (j + 1) * dim].transpose(1, 2) for j in range(3))
        if layout in ("contiguous", "lse"):
            q, k, v = (x.contiguous() for x in (q, k, v))
        do = torch.randn(batch, heads, seq, dim, dtype=torch.bfloat16, device="cuda")
        dlse = torch.randn(batch, heads, seq, device="cuda") if layout == "lse" else None
        dropout = SeededDropout(0.25, i) if "dropout" in case else None
        try:
            check_backend("triton", q, k, v, mask, do, key_lengths, dlse=dlse, score_mod=score_mod, dropout=dropout)
        except AssertionError as error:  # which call, and whether replays ran before it
            raise AssertionError(f"call {i} ({layout}), replays tried before it {ran}: {error}") from error
        if i == 0:  # the kernels compiling ahead compiled: the next calls launch them (are not standing in)
            sparseflash.wait_for_compiles()
    # (a backward replay of the kernels this case runs: the Gluon backward's, or the tuned Triton kernels')
    backward = (16, True, "gluon" if case.endswith("gluon") else "tuned")
    assert (backward in ran) != ("relbias" in case) and (8, True, True) in ran, f"replays tried: {ran}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["causal-d64-s300", "butterfly-d64-s300-keylen", "causal-d96-s300",
                                  "causal-d64-s300-keylen-dropout", "dense-d64-s512-gluon",
                                  "causal-d128-s1024-gluon-keylen"])
def test_gpu_graph_replays_read_each_calls_values(case, monkeypatch):
    """Calls on tensors that stay where they are, their values rewritten in place before each, as a training loop's
    steps, with key lengths made anew at addresses of their own and (dropout) a seed drawn by each call: from the
    third call the replays launch CUDA graphs, which read the key lengths and the seed from copies; each call's
    outputs against the reference on its own values, and graphs of the forward and of the backward (the Gluon one
    where the case says so, its dQ accumulator zeroed and converted in the graph) must have been launched."""
    import sparseflash
    from sparseflash.masks import make
    from tests.helpers import Outputs, attention_with_grads, check_outputs

    pattern, dim, seq = case.split("-")[0], int(case.split("-")[1][1:]), int(case.split("-")[2][1:])
    if "gluon" in case:
        if not launch.gluon_hopper(torch.device("cuda")):
            pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
        monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    graph_launches, tried = [], []  # (slots, the kept call's outcome, whether a graph was launched) of each try
    graph_replay, replay_call = torch.cuda.CUDAGraph.replay, replay.Replay.__call__
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (graph_launches.append(1), graph_replay(self)))

    def traced(self, slots):
        before = len(graph_launches)
        result = replay_call(self, slots)
        tried.append((len(slots), self.outcome, len(graph_launches) > before))  # (slots: 8 forward, 16 backward)
        return result

    monkeypatch.setattr(replay.Replay, "__call__", traced)
    mask = make(pattern, seq, block=64) if pattern == "butterfly" else pattern
    q, k, v, do = (torch.empty(2, 4, seq, dim, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    # each call's key lengths at an address of its own, allocated before the calls (allocated among them, the tensors
    # held would move the calls' own small allocations, which a loop's steps free and allocate again in place)
    held = [torch.empty(2, dtype=torch.int32, device="cuda") for _ in range(6)] if "keylen" in case else []
    # each call's inputs, dropout and outputs, on the CPU, detached (a CPU copy of o would keep its autograd graph
    # and the dropout seed the graph holds: the next call would allocate elsewhere)
    calls = []
    for i in range(6):
        for x in (q, k, v, do):
            x.copy_(torch.randn_like(x))
        key_lengths = held[i].random_(seq // 2, seq + 1) if held else None
        dropout = SeededDropout(0.25, i) if "dropout" in case else None
        got = attention_with_grads("triton", q, k, v, mask, do, key_lengths, dropout=dropout)
        calls.append(([x.cpu() for x in (q, k, v, do)], None if key_lengths is None else key_lengths.cpu(), dropout,
                      Outputs(*(x.detach().cpu() for x in got[:5]))))
        del got
        if i == 0:
            sparseflash.wait_for_compiles()
    backward = (16, "gluon" if "gluon" in case else "tuned", True)  # a graph of the backward this case runs
    assert (8, True, True) in tried and backward in tried, f"replays tried: {tried}"
    for i, (inputs, lengths, dropout, got) in enumerate(calls):
        try:
            check_outputs(Outputs(*(x.cuda() for x in got)), *(x.cuda() for x in inputs[:3]), mask,
                          inputs[3].cuda(), None if lengths is None else lengths.cuda(), dropout=dropout)
        except AssertionError as error:
            raise AssertionError(f"call {i} ({len(graph_launches)} graph launches in all): {error}") from error
