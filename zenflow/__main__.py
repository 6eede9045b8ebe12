"""`python -m zenflow ...` is the `zenflow` command."""
import sys

from zenflow.tools.cli import main

sys.exit(main())
