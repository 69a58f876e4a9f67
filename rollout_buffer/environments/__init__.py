"""Environments users already have, each in its own interpreter: processes the buffer starts and drives.

pool (a run's processes, leased least busy first, a dead one replaced; EnvError), workers (verifiers worker
processes, JSON lines on their stdin/stdout), verifiers_worker (the script a verifiers venv runs; never imported
here), openenv_client (OpenEnv's WebSocket protocol, without OpenEnv), openenv_servers (a URL, or servers
started from a command), processes (tied to the buffer, as another user, ended), venvs (a venv per requirement
list).

May import: nothing of the service. Imported by: the generator API (for the `verifiers` and `openenv` task types,
and agent commands' `fate_shared`).
"""
