"""The trainer's exit: nothing that holds a process group is left for the interpreter's teardown."""

from __future__ import annotations

import re

import pytest

from tests.trainer_helpers import describe, launch, write_job


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["dp=2,tp=1,pp=1,mbs=4,gbs=16", "dp=1,tp=2,pp=1,mbs=4,gbs=16"])
def test_no_process_group_is_left_to_the_interpreter_teardown(tmp_path, strategy):
    """FSDP2's state and the model's DTensors form reference cycles that hold the device meshes and so the process
    groups. Freed by the interpreter's teardown, after `destroy_process_group`, a rank could abort (exit -6) after a
    clean exit record, and torchrun then reports the whole attempt as crashed (seen on loaded CI machines). The
    trainer collects them before it destroys the process group: at exit no torch.distributed or torch.nn object is
    left in a cycle."""
    job = write_job(tmp_path, checkpoint={"interval_steps": 1000, "keep": 1})
    result = launch(tmp_path / "run", nproc=2, strategy=strategy, job=job, max_steps=2,
                    module="tests.exit_garbage_trainer")  # fmt: skip
    assert result.returncode == 0, describe(result)
    lines = re.findall(r"^exit garbage: (\d+) (.*)$", result.stderr, flags=re.M)
    assert len(lines) == 2, describe(result)  # one per rank
    assert all(count == "0" for count, _ in lines), lines
