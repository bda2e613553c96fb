"""`python -m jhicache.serve`: runs the server's command line (see jhicache.serve.cli)."""

from jhicache.serve.cli import main

if __name__ == "__main__":
    main()
