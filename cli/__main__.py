"""`python -m kvtier.cli` runs the `kvtier` command."""

from kvtier.cli.main import main

if __name__ == "__main__":
    main()
