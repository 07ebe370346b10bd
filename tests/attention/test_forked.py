"""``forked``: a task run in a child process forked from the caller, waited for through a Future."""

from __future__ import annotations

import os
import sys
import time

import pytest

from sparseflash.attention.triton import forked


def test_a_task_runs_in_a_child_and_its_future_resolves_when_it_exits(tmp_path):
    out = tmp_path / "pid"
    child = forked.start(lambda: out.write_text(str(os.getpid())))
    assert forked.wait(child, timeout=30)
    assert child.result() is None and int(out.read_text()) == child.pid != os.getpid()


@pytest.mark.parametrize("task", ["raises", "exits"])
def test_a_task_that_fails_fails_its_future(task):
    def fail():
        if task == "raises":
            raise ValueError("in the child")
        os._exit(3)

    child = forked.start(fail)
    assert not forked.wait(child, timeout=30)
    assert isinstance(child.exception(), forked.ChildFailed)


def test_a_child_past_its_timeout_is_killed():
    child = forked.start(lambda: time.sleep(60))
    start = time.perf_counter()
    assert not forked.wait(child, timeout=0.3)
    assert time.perf_counter() - start < 10
    assert "exit status -9" in str(child.exception())  # SIGKILL


def test_the_child_prints_nothing_through_the_parents_streams(tmp_path, capfd):
    out = tmp_path / "done"

    def task():
        print("from the child", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        out.write_text("done")

    assert forked.wait(forked.start(task), timeout=30)
    assert out.read_text() == "done"
    captured = capfd.readouterr()
    assert "from the child" not in captured.out and "to stderr" not in captured.err


def test_wait_all_waits_for_every_child_started_and_tells_a_timeout(tmp_path):
    """``sparseflash.wait_for_compiles``'s wait: every child's task ended when it returns True (two children of
    unequal lengths); False after its timeout while one still runs, which it leaves running."""
    import sparseflash

    outs = [tmp_path / "fast", tmp_path / "slow"]
    children = [forked.start(lambda: outs[0].write_text("done")),
                forked.start(lambda: (time.sleep(1.0), outs[1].write_text("done")))]
    assert sparseflash.wait_for_compiles(timeout=60)
    assert all(child.done() for child in children) and all(out.read_text() == "done" for out in outs)
    sleeper = forked.start(lambda: time.sleep(60))
    start = time.perf_counter()
    assert not forked.wait_all(timeout=0.3)
    assert time.perf_counter() - start < 10 and not sleeper.done()
    assert not forked.wait(sleeper, timeout=0)  # killed: the next test finds no child left
    assert forked.wait_all(timeout=30)
