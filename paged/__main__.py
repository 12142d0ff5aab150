"""`python -m paged ...`: see `paged.cli`."""
import sys

from paged.cli import main

if __name__ == "__main__":
    sys.exit(main())
