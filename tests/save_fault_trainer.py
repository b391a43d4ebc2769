"""`python -m tests.save_fault_trainer ...`: the trainer (`cona.trainer.main`) with a checkpoint-save failure
injected on ONE rank, for `tests/test_storage_faults.py`.

`CONA_TEST_SAVE_FAULT=RANK:WHERE[@STEP]` (unset: the plain trainer) makes every checkpoint save (with `@STEP`, only the
save of optimizer step STEP) fail on rank RANK only, where a real one can fail on one node alone (a read-only mount, a
permission error, a bug in a planner):

- `writer`: creating DCP's storage writer raises PermissionError, before DCP's first collective;
- `write`:  writing the shards raises PermissionError, inside DCP's collectives;
- `marker`: writing the COMPLETE marker raises PermissionError, after the shards are on storage (rank 0 writes it);
- `kill`:   writing the shards SIGKILLs the rank (the OOM killer, a process dying inside DCP's collectives): the
            others are left in collectives that never complete, and torchrun's SIGTERM must still end them.
- `stop`:   writing the shards SIGSTOPs the rank (a hung process or node): the others wait in DCP's collectives
            until `parallel.collective_timeout_s`.

The trainer code stays free of test hooks: the patches are made here, in the worker, before `main` runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _install(rank: int, where: str, step: int | None = None) -> None:
    from cona.trainer import checkpoint as ckpt
    from torch.distributed.checkpoint import filesystem

    if int(os.environ.get("RANK", "0")) != rank:
        return

    def failing(path: Any) -> bool:  # a checkpoint directory, not a test's dump of the loaded state
        name = os.path.basename(str(path).rstrip("/"))
        return name.startswith("step-") and (step is None or name == f"step-{step:08d}")

    error = PermissionError(13, "Permission denied (injected on one rank)")
    if where == "writer":
        real_init = filesystem.FileSystemWriter.__init__

        def init(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
            if failing(path):
                raise error
            real_init(self, path, *args, **kwargs)

        filesystem.FileSystemWriter.__init__ = init  # type: ignore[method-assign]
    elif where == "write":
        real_write = filesystem._FileSystemWriter.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            if failing(self.path):
                raise error
            return real_write(self, plan, planner)

        filesystem._FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    elif where in ("kill", "stop"):
        import signal

        real_write_data = filesystem._FileSystemWriter.write_data
        sig = signal.SIGKILL if where == "kill" else signal.SIGSTOP

        def write_data_then_die(self: Any, plan: Any, planner: Any) -> Any:
            if failing(self.path):
                os.kill(os.getpid(), sig)
            return real_write_data(self, plan, planner)

        filesystem._FileSystemWriter.write_data = write_data_then_die  # type: ignore[method-assign]
    elif where == "marker":
        real_atomic = ckpt.atomic_write_json

        def atomic_write_json(path: Any, data: Any) -> None:
            if os.path.basename(str(path)) == ckpt.COMPLETE_MARKER and failing(os.path.dirname(str(path))):
                raise error
            real_atomic(path, data)

        ckpt.atomic_write_json = atomic_write_json  # type: ignore[assignment]
    else:
        raise SystemExit(f"CONA_TEST_SAVE_FAULT: unknown place {where!r}")


def main() -> int:
    fault = os.environ.get("CONA_TEST_SAVE_FAULT")
    if fault:
        rank, where = fault.split(":", 1)
        where, _, step = where.partition("@")
        _install(int(rank), where, int(step) if step else None)
    from cona.trainer.main import main as trainer_main

    return trainer_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
