"""`python -m tests.exit_garbage_trainer ...`: the trainer (`cona.trainer.main`), and then what the interpreter's
teardown would still have to free, for `tests/test_trainer_exit.py`.

After `main` returns, one garbage collection with `DEBUG_SAVEALL` finds the objects in reference cycles, which only
the teardown frees otherwise. The torch.distributed and torch.nn objects among them (FSDP2's state, the DTensors of
the model, through them the device meshes and their process groups) are written to stderr as one line:
`exit garbage: N {type: count}`.
"""

from __future__ import annotations

import collections
import gc
import os
import sys

from cona.trainer.main import main

if __name__ == "__main__":
    status = main()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    torch_kinds = {k: n for k, n in kinds.items() if k.startswith(("torch.distributed", "torch.nn"))}
    # One write of the whole line: the ranks share torchrun's stderr, and print's separate write of the newline let
    # two ranks' lines run together ("exit garbage: 0 {}exit garbage: 0 {}", seen once in CI).
    os.write(sys.stderr.fileno(), f"exit garbage: {sum(torch_kinds.values())} {torch_kinds}\n".encode())
    sys.exit(status)
