"""`python -m cona.trainer` (see trainer.main)."""

import faulthandler
import sys

from cona.trainer.main import main

# The process's entry, not `main` (which tests call in-process, where stderr may have no file descriptor): a crash
# in native code (an abort in a collective library, a segfault) leaves the Python stack of every thread in the
# node's log instead of only torchrun's "exitcode -6".
faulthandler.enable(all_threads=True)
sys.exit(main())
