"""make demo: the butterfly output matches the reference, and the speed-up is printed beside 1/density."""

import re

from sparseflash.demo import main


def test_demo_prints_speedup_and_ideal(capsys):
    main(["--seq-len", "256", "--block", "32", "--heads", "2", "--head-dim", "16"])
    out = capsys.readouterr().out
    assert re.search(r"\(\d+\.\d\dx faster than dense; 1/density = 2\.00x\)", out), out  # 8 blocks, density 0.5
    assert float(out.rsplit("max |butterfly - reference|: ", 1)[1]) < 1e-5
