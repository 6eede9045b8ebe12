"""`python -m zenflow ...` is the `zenflow` command."""
import sys

from zenflow.cli import main

sys.exit(main())
