"""`python -m cona.trainer` (see trainer.main)."""

import sys

from cona.trainer.main import main

sys.exit(main())
