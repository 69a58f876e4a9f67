"""Benchmarks of the rollout buffer, run by hand (`python -m bench.<name> --help`); not part of CI."""
