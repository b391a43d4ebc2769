"""`python -m trainer` (see trainer.main)."""

import sys

from trainer.main import main

sys.exit(main())
