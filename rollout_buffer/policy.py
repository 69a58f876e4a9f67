"""What the operator lets clients name: the server-side policy every run option that runs code, reads or creates
paths, sets a child's environment, picks a sandbox or reaches a host passes through.

The operator decides (`serve` flags, or a YAML file given to `--policy`); a client (slime, a script, a web page
that got through) only chooses among what was allowed. Run options declare what they govern with a `Governed`
marker on their field (`Annotated[str | None, Governed("code")]`); `Policy.check` judges one value and raises
`PolicyRefused`, which names the option and the flag that would allow it (the server answers 403).

The kinds:
- `read`: a file or folder the server reads (`input_file`, `tokenizer_path`): under a read root (the data dir,
  the bundled data and tokenizer, `--data-root`), links resolved.
- `code`: `path/file.py:function` (under an `--allow-code` path) or `module:function` (an `--allow-module`); a
  bare name (`auto`, `math`) is the generator's built-in and passes.
- `program`: a command line (its program) or a program path, found on the server's PATH: under an
  `--allow-code` path (links in its folders resolved, not the program itself: a venv's `bin/python`).
- `code_paths`, `workdir`: folders Python imports from, or the server makes scratch folders in: under an
  `--allow-code` path.
- `packages`: requirement lists installed from a package index: `--allow-installs`.
- `child_env`: variables set in a child's environment: each name matches an `--allow-env` pattern.
- `image`: a container image: an `--allow-image`.
- `user`: the user children run as: one of `--agent-user` (default: `nobody` when the server runs as root, else
  the server's own user).
- `network`: a sandbox's network: no less isolated than `--agent-network` (host < auto < isolated).
- `urls`: hosts the server sends requests to: http(s), at most `max_urls`, under `--engine-host` when set.
- Images named by URL in an agent's messages are fetched only from `--image-url-host` hosts (none by default).
- `secret`: values kept from views (`/status`, the dashboard, logs, exports); `child_env` values are secret too.
"""

from __future__ import annotations

import fnmatch
import os
import pwd
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

Kind = Literal["read", "code", "program", "code_paths", "workdir", "packages", "child_env", "image", "user",
               "network", "urls", "secret"]
Network = Literal["host", "auto", "isolated"]
NETWORKS: tuple[Network, ...] = ("host", "auto", "isolated")  # from least to most isolated
# A command's program that names the interpreter of the venv the server makes from a run's requirements (which the
# `packages` kind governs).
VENV_PYTHON = "{python}"
# Engine URLs one run may name (a router, or its engines); more is a mistake or an attack.
MAX_URLS = 256
# Option names whose values are secrets wherever they appear (run options, views, exports).
SECRET_SUFFIXES = ("_token", "api_key", "_secret", "_password", "_env")
SECRET_NAMES = frozenset({"token", "apikey", "password", "secret", "authorization", "x-api-key"})
REDACTED = "***"


@dataclass(frozen=True)
class Governed:
    """Marks a run option's field as naming something the policy governs; `kind` says what (module docstring).

    `fill`: a run that leaves the option out runs with the policy's value (the sandbox kinds), written into its
    settings. `unless`: (option, value) under which the check does not apply (a command run in a container names
    the image's program, not one of this machine)."""

    kind: Kind
    fill: bool = False
    unless: tuple[str, Any] | None = None


class PolicyRefused(Exception):
    """A run option the server's policy does not allow: 403 naming the option and what would allow it."""

    status = 403

    def __init__(self, option: str, message: str, allow: str):
        super().__init__(f"{option}: {message}; {allow}")
        self.option = option
        self.allow = allow


def is_secret_name(name: str) -> bool:
    """Whether an option or key named `name` holds a secret (`*_token`, `*_key`, `*_env`, `api_key`, ...)."""
    lowered = name.lower()
    return lowered in SECRET_NAMES or lowered.endswith(SECRET_SUFFIXES)


def redacted(value: Any) -> Any:
    """`value` with every secret-named key's value replaced by `***`, at any depth (a copy; the input is kept)."""
    if isinstance(value, dict):
        return {k: _masked(v) if isinstance(k, str) and is_secret_name(k) else redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return value


def _masked(value: Any) -> Any:
    # A mapping of variables keeps its names (what was set is worth seeing), never its values.
    if isinstance(value, dict):
        return {k: REDACTED for k in value}
    return value if value in (None, "", []) else REDACTED


def host_allowed(host: str, hosts: Sequence[str]) -> bool:
    """Whether `host` matches one of `hosts` (names, addresses or `fnmatch` patterns; empty: any host)."""
    host = host.lower()
    return not hosts or any(fnmatch.fnmatchcase(host, h.lower()) for h in hosts)


def default_agent_user() -> str:
    """`nobody` when the server runs as root (children then run as another user), else the server's own user."""
    return "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


def _under(path: Path, roots: Iterable[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def _resolved(raw: str | Path, follow_last: bool = True) -> Path:
    """`raw` made absolute (from the server's working directory) with `..` and links resolved; with
    `follow_last` False the last component is kept as it is (a venv's `bin/python` is a link out of it)."""
    path = Path(os.path.abspath(os.path.expanduser(str(raw))))
    if follow_last:
        return path.resolve()
    return path.parent.resolve() / path.name


@dataclass(frozen=True)
class Policy:
    """What clients may name (module docstring); the defaults refuse every program, install and variable."""

    read_roots: tuple[Path, ...] = ()
    code_roots: tuple[Path, ...] = ()
    modules: tuple[str, ...] = ()
    installs: bool = False
    child_env: tuple[str, ...] = ()
    images: tuple[str, ...] = ()
    users: tuple[str, ...] = ()  # the first is the default; empty: `default_agent_user()` alone
    network: Network = "auto"
    engine_hosts: tuple[str, ...] = ()  # empty: any host
    max_urls: int = MAX_URLS
    image_url_hosts: tuple[str, ...] = ()  # hosts images named by URL are fetched from; empty: none
    # The resolved roots, computed once: a check must not resolve the operator's folders per request.
    _read: tuple[Path, ...] = field(default=(), init=False, repr=False, compare=False)
    _code: tuple[Path, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ValueError(f"agent network must be one of {', '.join(NETWORKS)}")
        if self.max_urls < 1:
            raise ValueError("max_urls must be at least 1")
        object.__setattr__(self, "_read", tuple(_resolved(r) for r in self.read_roots))
        object.__setattr__(self, "_code", tuple(_resolved(r) for r in self.code_roots))

    @classmethod
    def from_file(cls, path: Path) -> Policy:
        """The policy a YAML file states (docs/security.md shows one); ValueError naming what is wrong."""
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--policy {path}: cannot be read: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--policy {path}: expected a mapping of settings")
        keys = {"read": "read_roots", "code": "code_roots", "modules": "modules", "installs": "installs",
                "env": "child_env", "images": "images", "agent_users": "users", "agent_network": "network",
                "engine_hosts": "engine_hosts", "max_urls": "max_urls", "image_url_hosts": "image_url_hosts"}
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise ValueError(f"--policy {path}: unknown setting {unknown[0]!r}; known: {', '.join(keys)}")
        values: dict[str, Any] = {}
        for key, name in keys.items():
            if key not in data:
                continue
            value = data[key]
            if name in ("installs",):
                if not isinstance(value, bool):
                    raise ValueError(f"--policy {path}: {key} must be true or false")
            elif name in ("network",):
                if value not in NETWORKS:
                    raise ValueError(f"--policy {path}: {key} must be one of {', '.join(NETWORKS)}")
            elif name == "max_urls":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"--policy {path}: {key} must be a positive integer")
            else:
                if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                    raise ValueError(f"--policy {path}: {key} must be a list of strings")
                value = tuple(Path(v) if name in ("read_roots", "code_roots") else v for v in value)
            values[name] = value
        return cls(**values)

    def merged(self, other: Policy) -> Policy:
        """This policy with `other`'s allowances added (flags on top of a file); `other`'s network and first
        user win where it sets them."""
        return replace(
            self,
            read_roots=(*self.read_roots, *other.read_roots), code_roots=(*self.code_roots, *other.code_roots),
            modules=(*self.modules, *other.modules), installs=self.installs or other.installs,
            child_env=(*self.child_env, *other.child_env), images=(*self.images, *other.images),
            users=(*other.users, *self.users), network=other.network if other.network != "auto" else self.network,
            engine_hosts=(*self.engine_hosts, *other.engine_hosts), max_urls=min(self.max_urls, other.max_urls),
            image_url_hosts=(*self.image_url_hosts, *other.image_url_hosts),
        )

    @property
    def agent_user(self) -> str:
        """The user children run as when a run names none."""
        return self.users[0] if self.users else default_agent_user()

    # ---- one value

    def check(self, option: str, kind: Kind, value: Any) -> Any:
        """`value` of run option `option` if the policy allows it; PolicyRefused otherwise. Values of the wrong type
        are left to the option's own validation. For the sandbox kinds, a None value asks what a run that leaves
        the option out must run with: the operator's setting where it differs from the option's own default,
        else None."""
        if value is None and kind not in ("user", "network"):
            return value
        check = getattr(self, f"_check_{kind}")
        result: Any = check(option, value)
        return result

    def readable(self, option: str, raw: str) -> Path:
        """The resolved path of a file or folder a client names for the server to read; PolicyRefused outside the
        read roots, whether or not it exists (a refusal tells nothing of what is there)."""
        path = _resolved(raw)
        if not _under(path, self._read):
            raise PolicyRefused(option, f"{raw} is outside the folders this server reads from",
                                "start the server with --data-root FOLDER to allow a folder holding it")
        return path

    def _check_read(self, option: str, value: Any) -> Any:
        if isinstance(value, str):
            self.readable(option, value)
        return value

    def _code_path(self, option: str, raw: str, follow_last: bool = True) -> Path:
        path = _resolved(raw, follow_last)
        if not _under(path, self._code):
            raise PolicyRefused(option, f"{raw} is not among the programs and folders this server lets clients "
                                "name", "start the server with --allow-code PATH (the program, file or a folder "
                                "holding it) to allow it")
        return path

    def _check_code(self, option: str, value: Any) -> Any:
        if not isinstance(value, str) or ":" not in value:
            return value  # a built-in name (`auto`, `math`), or a bad value the option's validation refuses
        module_part = value.rpartition(":")[0]
        if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
            self._code_path(option, module_part)
            return value
        allowed = any(module_part == m or module_part.startswith(m + ".") for m in self.modules)
        if not allowed:
            raise PolicyRefused(option, f"module {module_part!r} is not among the modules this server lets "
                                "clients name", f"start the server with --allow-module {module_part} to allow it")
        return value

    def _check_program(self, option: str, value: Any) -> Any:
        program = value[0] if isinstance(value, list) and value and isinstance(value[0], str) else value
        if not isinstance(program, str) or not program or program == VENV_PYTHON:
            return value
        found = program if os.sep in program else shutil.which(program)
        if found is None:
            raise PolicyRefused(option, f"program {program!r} is not on the server's PATH, so not among the "
                                "programs it lets clients name", "start the server with --allow-code PATH (the "
                                "program's path) and name it by that path")
        self._code_path(option, found, follow_last=False)
        return value

    def _check_code_paths(self, option: str, value: Any) -> Any:
        for raw in value if isinstance(value, list) else [value]:
            if isinstance(raw, str):
                self._code_path(option, raw)
        return value

    def _check_workdir(self, option: str, value: Any) -> Any:
        if isinstance(value, str):
            self._code_path(option, value)
        return value

    def _check_packages(self, option: str, value: Any) -> Any:
        if not self.installs:
            raise PolicyRefused(option, "installing packages from an index runs their code, which this server does "
                                "not let clients ask for", "start the server with --allow-installs to allow it, or "
                                "give an interpreter the server allows (--allow-code)")
        return value

    def _check_child_env(self, option: str, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        for name in value:
            if not any(fnmatch.fnmatchcase(str(name), pattern) for pattern in self.child_env):
                raise PolicyRefused(f"{option}.{name}", "this variable is not among those the server lets clients "
                                    "set in a child's environment",
                                    f"start the server with --allow-env {name} to allow it")
        return value

    def _check_image(self, option: str, value: Any) -> Any:
        if isinstance(value, str) and value not in self.images:
            raise PolicyRefused(option, f"image {value!r} is not among the images this server lets clients name",
                                f"start the server with --allow-image {value} to allow it")
        return value

    def _check_user(self, option: str, value: Any) -> Any:
        if value is None:
            return self.users[0] if self.users else None
        if not isinstance(value, str):
            return value
        allowed = self.users or (default_agent_user(),)
        if value not in allowed:
            raise PolicyRefused(option, f"children run as {', '.join(allowed)} on this server, not {value!r}",
                                f"start the server with --agent-user {value} to allow it")
        return value

    def _check_network(self, option: str, value: Any) -> Any:
        if value is None:  # an option's default is `auto`: only a stricter floor changes it
            return self.network if self.network == "isolated" else None
        if value in NETWORKS and NETWORKS.index(value) < NETWORKS.index(self.network):
            raise PolicyRefused(option, f"{value!r} is less isolated than this server's {self.network!r}",
                                f"start the server with --agent-network {value} to allow it")
        return value

    def _check_urls(self, option: str, value: Any) -> Any:
        urls = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if len(urls) > self.max_urls:
            raise ValueError(f"{option}: {len(urls)} URLs; a run names at most {self.max_urls}")
        for url in urls:
            if isinstance(url, str):
                self.reachable(option, url)
        return value

    def reachable(self, option: str, url: str) -> str:
        """`url` if the server may send requests to it: http(s), and its host allowed when `--engine-host` is set;
        ValueError for a malformed URL, PolicyRefused for a host outside the list."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{option}: {url!r} must be an http:// or https:// URL with a host")
        host = parts.hostname.lower()
        if not host_allowed(host, self.engine_hosts):
            raise PolicyRefused(option, f"host {host!r} is not among the engine hosts this server may reach",
                                f"start the server with --engine-host {host} to allow it")
        return url

    def _check_secret(self, option: str, value: Any) -> Any:
        return value


def policy_from_flags(read: Sequence[Path] = (), code: Sequence[Path] = (), modules: Sequence[str] = (),
                      installs: bool = False, env: Sequence[str] = (), images: Sequence[str] = (),
                      users: Sequence[str] = (), network: Network = "auto", engine_hosts: Sequence[str] = (),
                      image_url_hosts: Sequence[str] = (), file: Path | None = None) -> Policy:
    """The policy `serve`'s flags state, on top of `--policy FILE` when given."""
    flags = Policy(tuple(read), tuple(code), tuple(modules), installs, tuple(env), tuple(images), tuple(users),
                   network, tuple(engine_hosts), image_url_hosts=tuple(image_url_hosts))
    return Policy.from_file(file).merged(flags) if file is not None else flags
