"""`python -m sparsedec ...`: the same command line as the `sparsedec` script (sparsedec.cli)."""

import sys

from sparsedec.cli import main

sys.exit(main())
