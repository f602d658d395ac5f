"""`python -m cherenkov`: the command line."""

from cherenkov.cli import main
import sys
sys.exit(main())
