"""The `rollout-buffer` command: serve, demo, sim-engine and friends."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import logging
import sys
from pathlib import Path
from typing import NoReturn

import setproctitle

from rollout_buffer.config import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    EXECUTORS,
    ServerConfig,
    version,
)
from rollout_buffer.delivery.store import StoreError, check_store
from rollout_buffer.media.images import DEFAULT_MAX_IMAGE_BYTES
from rollout_buffer.observability.logs import ACCESS_LOG_MODES, setup_logging
from rollout_buffer.policy import NETWORKS, Policy, policy_from_flags
from rollout_buffer.server.listeners import agent_socket, tcp_listener
from rollout_buffer.shortcuts import switch as shortcuts
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path
from rollout_buffer.tools import demo

log = logging.getLogger(__name__)


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help says it already; the epilog is kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (False, argparse.SUPPRESS) or not action.option_strings:
            return text
        default = "none" if action.default in (None, []) else "%(default)s"
        return f"{text} (default: {default})" if text else f"(default: {default})"


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="run the rollout buffer HTTP server", formatter_class=HelpWithDefaults,
        epilog="examples:\n"
        "  rollout-buffer serve                                   # 127.0.0.1:8889, store in ./rollout_data\n"
        "  rollout-buffer serve --host 0.0.0.0 --data-dir /data --auth-token $TOKEN --data-root /inputs\n"
        "  rollout-buffer serve --generator-path ./my_generators --log-format json\n"
        "  rollout-buffer serve --executor ray --ray-address 10.0.0.1:6379   # trajectories on a Ray cluster\n"
        "  rollout-buffer serve --session-workers 4               # harness sessions served on ports 8890-8893",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (slime's --agent-rollout-buffer-url)")
    p.add_argument("--data-dir", type=Path, default=Path("rollout_data"),
                   help="the store (SQLite) and open sessions' files; made 0700")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help="group size for /buffer/write records sent before any /start_rollout")
    p.add_argument("--auth-token", default=None,
                   help="require 'Authorization: Bearer T' (also read from ROLLOUT_BUFFER_AUTH_TOKEN)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; larger ones are refused with 413")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help="largest image a trajectory may bring; larger ones are refused with the protocol's 400")
    p.add_argument("--hook-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long a generator's is_valid_group / transform_group may take; its group is dropped "
                        "(reason hook_timeout) past it")
    p.add_argument("--generator-path", type=Path, action="append", default=[],
                   help="extra generator .py file or folder (repeatable)")
    _policy_flags(p)
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name browsers may reach the server by (its Host header) besides loopback, --host and "
                   "--public-url's (repeatable; with --auth-token, requests presenting it are taken by any name)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a --host other than loopback without --auth-token (anyone who reaches the port may "
                   "start runs and read every trajectory); refused without this flag")
    p.add_argument("--max-db-mb", type=float, default=None,
                   help="cap the store's size; writes past it answer 503 as on a full disk")
    p.add_argument("--prune-delivered-after-h", type=float, default=None, metavar="HOURS",
                   help="cut the long records (64 KiB and more: coding agents' trajectories), and those with side "
                   "data or images, of groups every stream has delivered down to their facts once older than "
                   "HOURS: the row, reward and last message stay, the tokens and log-probs go; then the images "
                   "no record holds and nothing used for max(24, HOURS) hours (default: keep everything)")
    _scale_flags(p)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one JSON object per line")
    p.add_argument("--access-log", choices=ACCESS_LOG_MODES, default="info",
                   help="one line per agent request to a session's API (session, protocol, route, status, new "
                   "tokens, ms), logged at INFO, at DEBUG, or off (default: %(default)s)")
    p.add_argument("--no-shortcuts", nargs="?", const="all", default=None, metavar="NAMES",
                   help="use only the public APIs of uvicorn, FastAPI, transformers and jinja2: same answers, more "
                   f"CPU; or switch off only the shortcuts named ({','.join(shortcuts.NAMES)}; docs/development.md; "
                   "also ROLLOUT_BUFFER_SHORTCUTS=off)")


def _policy_flags(p: argparse.ArgumentParser) -> None:
    """What clients may name (the policy)."""
    policy = p.add_argument_group(
        "what clients may name (docs/security.md)",
        "By default a client may read input files and tokenizers in the data dir and the bundled data only, and "
        "may name no program, module, package, variable, image or host of its own. Each flag allows more; a "
        "refused option answers 403 naming the flag that would allow it.")
    policy.add_argument("--data-root", type=Path, action="append", default=[], metavar="FOLDER",
                        help="a folder clients may name files in for the server to read: input_file, tokenizer_path, "
                        "eval datasets (repeatable)")
    policy.add_argument("--allow-code", type=Path, action="append", default=[], metavar="PATH",
                        help="a program, Python file, venv or folder clients may name as code to run: agent, "
                        "agent_command, scorer, env_python, env_paths, openenv_command, tool_config_path, "
                        "agent_workdir_root (repeatable)")
    policy.add_argument("--allow-module", action="append", default=[], metavar="NAME",
                        help="a Python module (and its submodules) clients may name as module:function (repeatable)")
    policy.add_argument("--allow-installs", action="store_true",
                        help="let clients name requirements the server installs into a venv (env_requirements, "
                        "openenv_requirements): code from a package index")
    policy.add_argument("--allow-env", action="append", default=[], metavar="NAME",
                        help="a variable (or fnmatch pattern) clients may set in a child's environment: agent_env, "
                        "openenv_env (repeatable)")
    policy.add_argument("--allow-image", action="append", default=[], metavar="IMAGE",
                        help="a container image clients may name (agent_image of agent_sandbox docker; repeatable)")
    policy.add_argument("--agent-user", action="append", default=[], metavar="USER",
                        help="a user agents and environments may run as; the first is the default (default: nobody "
                        "when the server runs as root, else its own user; repeatable)")
    policy.add_argument("--agent-network", choices=NETWORKS, default="auto",
                        help="the least isolation a run may ask of its agents' network: a run may ask more, never "
                        "less (default: %(default)s, a namespace of its own where unshare works)")
    policy.add_argument("--engine-host", action="append", default=[], metavar="HOST",
                        help="a host (or fnmatch pattern) the server may send requests to: engine URLs, a router's "
                        "workers, retrieval and OpenEnv servers (repeatable; default: any host)")
    policy.add_argument("--image-url-host", action="append", default=[], metavar="HOST",
                        help="a host (or fnmatch pattern) images an agent names by URL are fetched from: no "
                        "redirects, within --max-image-bytes (repeatable; default: none, such a URL is a 400)")
    policy.add_argument("--policy", type=Path, default=None, metavar="FILE",
                        help="a YAML file stating all of the above (the flags add to it)")


def _scale_flags(p: argparse.ArgumentParser) -> None:
    """Where trajectories and agent sessions run: Ray, session workers."""
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="where trajectories run: asyncio tasks of this process, or a pool of Ray actors "
                   "(pip install 'rollout-buffer[ray]')")
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster of --executor ray (default: RAY_ADDRESS, else a local Ray started here)")
    p.add_argument("--ray-actors", type=int, default=None,
                   help="actors of --executor ray (default: one per CPU of the cluster)")
    p.add_argument("--public-url", default=None,
                   help="the buffer's URL as Ray actors on other nodes reach it, for the agent sessions they open "
                   "(default: http://127.0.0.1:PORT, or --host when it is a specific address)")
    p.add_argument("--session-workers", type=int, default=0, metavar="N",
                   help="serve harness sessions' endpoints from N worker processes (each on its own port; the "
                   "buffer keeps the store), so that proxied turns use more than one core (default: 0, this "
                   "process serves them)")
    p.add_argument("--session-worker-port", type=int, default=None, metavar="PORT",
                   help="the first session worker's port; the others follow it (default: --port + 1)")
    p.add_argument("--session-worker-cpus", type=float, default=1.0, metavar="CPUS",
                   help="with --executor ray the session workers run on the cluster's nodes, each reserving this "
                   "many CPUs (default: %(default)s)")
    p.add_argument("--session-worker-batch-ms", type=float, default=500.0, metavar="MS",
                   help="how long a session worker's finished records wait (in its outbox) for others before they go "
                   "to the buffer in one batch: the trainer sees them that much later (fewer, larger batches cost "
                   "the buffer less; default: %(default)s)")


def _policy(args: argparse.Namespace) -> Policy:
    """The policy `serve`'s flags state: the bundled data and tokenizer are always readable."""
    bundled = (Path(demo.bundled_dataset("math")).parent, Path(bundled_tokenizer_path()))
    return policy_from_flags(read=(*bundled, *args.data_root), code=args.allow_code, modules=args.allow_module,
                             installs=args.allow_installs, env=args.allow_env, images=args.allow_image,
                             users=args.agent_user, network=args.agent_network, engine_hosts=args.engine_host,
                             image_url_hosts=args.image_url_host, file=args.policy)


# `serve`'s exit status when it cannot start, one line on stderr saying why (docs/reliability.md).
EXIT_CONFIG = 2  # a bad option (argparse's usage errors exit 2 too)
EXIT_LISTEN = 3  # the port cannot be listened on
EXIT_STORE = 4  # the data dir or the store cannot be used


def _refuse_start(status: int, message: str) -> NoReturn:
    print(f"rollout-buffer serve: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig.with_env(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        group_size=args.group_size,
        auth_token=args.auth_token,
        max_body_bytes=args.max_body_bytes,
        max_image_bytes=args.max_image_bytes,
        hook_timeout_s=args.hook_timeout,
        generator_paths=tuple(args.generator_path),
        policy=_policy(args),
        allowed_hosts=tuple(args.allowed_host),
        insecure_no_auth=args.insecure_no_auth,
        max_db_bytes=int(args.max_db_mb * 1024 * 1024) if args.max_db_mb else None,
        prune_delivered_after_s=(None if args.prune_delivered_after_h is None
                                 else args.prune_delivered_after_h * 3600),
        executor=args.executor,
        ray_address=args.ray_address,
        ray_actors=args.ray_actors,
        public_url=args.public_url,
        session_workers=args.session_workers,
        session_worker_port=args.session_worker_port,
        session_worker_cpus=args.session_worker_cpus,
        session_worker_batch_ms=args.session_worker_batch_ms,
    )


def serve(args: argparse.Namespace) -> None:
    """Start uvicorn with the app built from the command-line options."""
    from rollout_buffer.server.app import create_app, stopping
    from rollout_buffer.shortcuts.quiet_server import serve as serve_app

    # One process holds thousands of trajectories in flight (messages, token lists). With the default
    # thresholds a collection runs every 700 container allocations and a full one every 70 000, each walking
    # every in-flight object and every module loaded (transformers, sympy, ...): at 4 096 in flight that was
    # over half of the buffer's CPU. Collections now run 70x less often, and the objects of start-up are
    # frozen out of them.
    gc.set_threshold(50_000, 20, 10)
    if args.auth_token:
        _mask_in_command_line(args.auth_token)
    if args.no_shortcuts is not None:
        try:
            shortcuts.switch_off(shortcuts.NAMES if args.no_shortcuts == "all" else args.no_shortcuts.split(","))
        except ValueError as e:
            _refuse_start(EXIT_CONFIG, f"--no-shortcuts: {e}")
    shortcuts.announce(log)

    try:
        config = _config(args)
    except ValueError as e:
        _refuse_start(EXIT_CONFIG, str(e))
    try:
        check_store(config.db_path)
    except StoreError as e:
        _refuse_start(EXIT_STORE, f"{e} (--data-dir {config.data_dir})")
    if config.insecure_no_auth and not config.auth_token:
        log.warning("serving %s without --auth-token (--insecure-no-auth): anyone who reaches port %d may start "
                    "runs and read every trajectory", config.host, config.port)
    with contextlib.ExitStack() as stack:
        try:
            listeners = [tcp_listener(config.host, config.port)]
        except OSError as e:
            _refuse_start(EXIT_LISTEN, f"cannot listen on {config.host}:{config.port}: {e.strerror or e} (another "
                          "server there? choose another --port)")
        sandboxes = agent_socket(stack)
        if sandboxes is not None:
            listeners.append(sandboxes[1])
            config = dataclasses.replace(config, agent_socket=sandboxes[0])
        app = create_app(config)
        gc.freeze()
        serve_app(app, listeners, args.log_level.lower(), on_stop=functools.partial(stopping, app))


# Subcommands that own their argument parsing: name → (module, help). Each module has `main(argv)`.
DELEGATED: dict[str, tuple[str, str]] = {
    "sim-engine": ("rollout_sim.server", "simulated SGLang engine for runs without a GPU"),
    "retriever": ("generators.retriever", "Search-R1 retrieval server (BM25) over a JSONL corpus"),
    "status": ("rollout_buffer.tools.status", "print a running buffer's run, progress and counts"),
    "export": ("rollout_buffer.tools.export", "write stored trajectories as JSONL"),
    "session-worker": ("rollout_buffer.server.session_worker", "a session worker (started by serve --session-workers)"),
}


def _mask_in_command_line(secret: str) -> None:
    """A token given as `--auth-token` leaves the process's command line: `ps`, /proc, and what Ray records as its
    job's entrypoint (the GCS job table, the dashboard) all read it from there."""
    setproctitle.setproctitle(" ".join(arg.replace(secret, "***") for arg in sys.orig_argv))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        module.main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="rollout-buffer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rollout-buffer {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo.add_parser(sub)
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=f"{help_text} (see `rollout-buffer {name} --help`)", add_help=False)
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"),
                  getattr(args, "access_log", "info"))
    if args.command == "serve":
        serve(args)
    elif args.command == "demo":
        demo.main(args)


if __name__ == "__main__":
    main()
