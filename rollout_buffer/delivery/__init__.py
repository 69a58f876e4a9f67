"""Delivery: the SQLite store (by concern: the store thread, schema and migrations, runs, records and group
completion, streams, reads, evals), the group policy, and the buffer that composes them: long-poll, leases, acks.

May import: observability, config, schemas. Knows generators only through their hooks (`HookSource`).
"""
