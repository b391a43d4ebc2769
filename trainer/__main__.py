"""`python -m cona.trainer` (see trainer.main)."""

import faulthandler
import os
import sys

from cona.trainer.main import main

# The process's entry, not `main` (which tests call in-process, where stderr may have no file descriptor): a crash
# in native code (an abort in a collective library, a segfault) leaves the Python stack of every thread in the
# node's log instead of only torchrun's "exitcode -6".
faulthandler.enable(all_threads=True)
# Every line in one write: the ranks share torchrun's stderr, and a write-through stderr (Python's default when it is
# no terminal) writes print's text and its newline separately, so two ranks' lines could run together.
if hasattr(sys.stderr, "reconfigure"):
    sys.stderr.reconfigure(line_buffering=True, write_through=False)
code = main()
# `main` has written the exit record, destroyed the process groups and closed its files. What is left is the
# interpreter's teardown of torch's modules, which every rank of every attempt pays before torchrun can report the
# attempt's end: 1.8 s of wall time from exit record to torchrun's exit with 4 ranks on 2 idle cores (about 0.4 CPU-s
# per rank), far more on a busy machine. Nothing after this point writes anything.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
