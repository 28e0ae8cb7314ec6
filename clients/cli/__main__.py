"""`python -m clients.cli`: the `tandem` command line, as the console script runs it."""

import sys

from clients.cli.main import main

sys.exit(main())
