"""`python -m jhicache.bench.kernels`: runs `cli.main`."""

from jhicache.bench.kernels.cli import main

if __name__ == "__main__":
    main()
