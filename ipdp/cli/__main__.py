"""`python -m ipdp.cli …` is the `ipdp` console script."""

import sys

from ipdp.cli.main import main

sys.exit(main())
