"""Generation: runs and their scheduler, the generator context, generator discovery and input-file checks.

May import: engine (the SGLang client), tokens (exact-token conversations), delivery (to store what it
generates), observability, config, schemas. Never `generators` or `slime_adapter` by name: built-in generators
are found by discovery.
"""
