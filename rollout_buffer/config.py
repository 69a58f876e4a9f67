"""Server configuration: one small typed object, validated at the edge, defaults written once."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from rollout_buffer.media.images import DEFAULT_MAX_IMAGE_BYTES
from rollout_buffer.policy import Policy


def version() -> str:
    """This release's version, as installed."""
    try:
        return importlib.metadata.version("rollout-buffer")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8889
# slime's rollout buffer groups writers that never called /start_rollout by 16.
DEFAULT_GROUP_SIZE = 16
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
AUTH_TOKEN_ENV = "ROLLOUT_BUFFER_AUTH_TOKEN"
EXECUTORS = ("local", "ray")


def is_loopback_host(host: str) -> bool:
    """Whether a bind address serves this machine alone (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Everything `rollout-buffer serve` needs to know."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = field(default_factory=lambda: Path("rollout_data"))
    group_size: int = DEFAULT_GROUP_SIZE
    auth_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The image store, when it is not under the data dir (a session worker keeps its images in its buffer's).
    images_dir: Path | None = None
    # The largest image a trajectory may bring (its bytes); larger ones are refused with the protocol's 400.
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    generator_paths: tuple[Path, ...] = ()
    # What clients may name: files to read, code to run, children's environment, sandbox, hosts to reach.
    policy: Policy = field(default_factory=Policy)
    # Host names requests may name besides loopback, the bind address and `public_url`'s (`Host` header).
    allowed_hosts: tuple[str, ...] = ()
    # Serve a network address without a token: anyone who reaches the port may start runs. Refused unless set.
    insecure_no_auth: bool = False
    progress_log_s: float = 10.0
    # How long a generator's group hook (`is_valid_group`, `transform_group`) may take before its group is
    # dropped with the reason `hook_timeout`.
    hook_timeout_s: float = 60.0
    # Cap on the SQLite file; writes past it answer 503 like a full disk. None: only the disk limits it.
    max_db_bytes: int | None = None
    # Long records of delivered groups are cut down to their facts once older than this (`delivery.retention`).
    # None: never.
    prune_delivered_after_s: float | None = None
    # A Unix socket the server also listens on that serves only the agent session endpoints, each with its
    # session's key: how sandboxed agents without network reach the buffer. None: no such socket.
    agent_socket: Path | None = None
    # Where trajectories run: "local" (asyncio tasks of this process) or "ray" (a pool of Ray actors).
    executor: str = "local"
    # The Ray cluster of the `ray` executor (`ray.init(address=...)`); None starts a local one.
    ray_address: str | None = None
    # Actors of the `ray` executor's pool; None: one per CPU of the cluster (a run's `ray_actors` overrides it).
    ray_actors: int | None = None
    # The buffer's URL as Ray actors (on any node) reach it, for the agent sessions they open; None: `local_url`.
    public_url: str | None = None
    # Processes serving harness sessions' endpoints (0: this process serves them), on consecutive ports from
    # `session_worker_port` (None: the port after the buffer's).
    session_workers: int = 0
    session_worker_port: int | None = None
    # CPUs each session worker reserves on the Ray cluster (`--executor ray`).
    session_worker_cpus: float = 1.0
    # How long a session worker's finished records wait in its outbox for others before they go to the buffer in
    # one batch (a harness's finish at the worker is answered once they are in the outbox): each batch costs the
    # buffer a request and a transaction, whatever it carries.
    session_worker_batch_ms: float = 500.0

    def __post_init__(self) -> None:
        if self.data_dir not in self.policy.read_roots:  # the data dir is always readable (a listing's input)
            object.__setattr__(self, "policy", replace(self.policy, read_roots=(self.data_dir,
                                                                                 *self.policy.read_roots)))
        if not self.auth_token and not self.insecure_no_auth and not is_loopback_host(self.host):
            raise ValueError(f"--host {self.host} serves the network without a token: anyone who reaches the port "
                             "could start runs; give --auth-token T (or ROLLOUT_BUFFER_AUTH_TOKEN), or "
                             "--insecure-no-auth to serve it open anyway")
        if self.group_size < 1:
            raise ValueError("group_size must be at least 1")
        if not 0 < self.port < 65536:
            raise ValueError("port must be between 1 and 65535")
        if self.hook_timeout_s <= 0:
            raise ValueError("hook_timeout_s must be positive")
        if self.prune_delivered_after_s is not None and self.prune_delivered_after_s < 0:
            raise ValueError("prune_delivered_after_s must be 0 or more")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}")
        if self.ray_actors is not None and self.ray_actors < 1:
            raise ValueError("ray_actors must be at least 1")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ValueError("public_url must be an http:// or https:// URL")
        if self.session_workers < 0:
            raise ValueError("session_workers must be 0 or more")
        if self.session_worker_cpus < 0:
            raise ValueError("session_worker_cpus must be 0 or more")
        if not 0 <= self.session_worker_batch_ms <= 10_000:
            raise ValueError("session_worker_batch_ms must lie between 0 and 10000")
        first = self.first_worker_port
        if self.session_workers and not (0 < first and first + self.session_workers <= 65536):
            raise ValueError("session_worker_port: the session workers' ports must lie between 1 and 65535")
        if self.session_workers and first <= self.port < first + self.session_workers:
            raise ValueError("session_worker_port: the session workers' ports must not include the buffer's")

    @property
    def local_url(self) -> str:
        """The buffer as processes of this machine reach it (a wildcard bind address is reached on loopback)."""
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def first_worker_port(self) -> int:
        """The first session worker's port (the others follow it)."""
        return self.session_worker_port if self.session_worker_port is not None else self.port + 1

    @property
    def buffer_url(self) -> str:
        """The buffer as Ray actors reach it: `public_url`, else `local_url`."""
        return (self.public_url or self.local_url).rstrip("/")

    @property
    def db_path(self) -> Path:
        """The SQLite file under the data dir."""
        return self.data_dir / "buffer.sqlite"

    @property
    def image_dir(self) -> Path:
        """Where the images records name are kept: the buffer's data dir's `images/` (a session worker's is its
        buffer's, `images_dir`)."""
        return self.images_dir or self.data_dir / "images"

    @classmethod
    def with_env(cls, **kwargs: object) -> ServerConfig:
        """Build a config, taking the auth token from the environment when not given."""
        if not kwargs.get("auth_token"):
            kwargs["auth_token"] = os.environ.get(AUTH_TOKEN_ENV) or None
        return cls(**kwargs)  # type: ignore[arg-type]
