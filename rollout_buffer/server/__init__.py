"""The HTTP surface: the FastAPI app (`app.create_app`), its routes, body parsing and middleware.

May import: generation, delivery, observability, config, schemas. Nothing imports it but the tools.
"""
