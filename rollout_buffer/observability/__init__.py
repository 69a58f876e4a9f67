"""Observability: Prometheus metrics and logging set-up.

Written to from every room; imports nothing of the service, so it can never close an import circle.
State the service keeps (ready groups, run progress) is handed to `metrics.render` by the caller.
"""
