"""`python -m jhicache.bench_kernels`: runs `cli.main`."""

from jhicache.bench_kernels.cli import main

if __name__ == "__main__":
    main()
