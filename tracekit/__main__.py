"""`python -m tracekit ...`: the same as the `tracekit` command."""
from .cli import main

if __name__ == "__main__":
    main()
