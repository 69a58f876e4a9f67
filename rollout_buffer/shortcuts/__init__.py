"""Every shortcut around a dependency's public API, in one place: templates (transformers' compiled chat
templates and jinja2's sandbox decisions), fast_routes (routes served ahead of FastAPI's router),
http_protocol (uvicorn's protocol writing a response in one piece), quiet_server (uvicorn's server without
its tick).

Each checks what it relies on and has a fallback that stays correct; a test fails loudly when a dependency
changes it. May import: nothing of the service.
"""
