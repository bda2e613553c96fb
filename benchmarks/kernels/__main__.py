"""`python -m benchmarks.kernels`: runs `cli.main`."""

from benchmarks.kernels.cli import main

if __name__ == "__main__":
    main()
