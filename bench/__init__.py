"""The project's benchmark: `python -m bench.run --out bench/results.json` (`make bench`)."""
