"""sparseflash.logging: trimming a metrics file for a resumed run, and console lines without Hydra."""

import json
import logging

from sparseflash.logging import JsonlSink, console_fallback, drop_records_after


def test_drop_records_after_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (0, 1, 2, 3, 4):
        sink.log({"loss": float(step)}, step=step)
    sink.log({"note": "no step"}, step=None)
    sink.close()
    with open(path, "a") as f:
        f.write('{"step": 2, "loss"')  # a record cut short by a crash
    assert drop_records_after(path, 2) == 3
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, None]
    assert drop_records_after(path, 2) == 0 and drop_records_after(tmp_path / "absent.jsonl", 2) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


def test_console_lines_print_when_logging_is_not_configured(capsys, monkeypatch):
    logger = logging.getLogger("sparseflash.test_console")
    monkeypatch.setattr(logging.root, "handlers", [])  # as in a plain script (pytest adds its own)
    with console_fallback():
        logger.info("step 7 | loss 0.1235")
        logger.info("a line")
    logger.info("after the block: not shown")
    assert capsys.readouterr().out == "step 7 | loss 0.1235\na line\n"
