"""Generation: runs and their scheduler, the generator context, the SGLang engine client, the exact-token
conversation, the tokenizer, generator discovery and input-file checks.

May import: delivery (to store what it generates), observability, config, schemas. Never `generators` or
`slime_adapter` by name: built-in generators are found by discovery.
"""
