"""Delivery: the SQLite store, group completion (filters, normalization), long-poll, leases and acks.

May import: observability, config, schemas. Knows generators only through their hooks (`HookSource`).
"""
