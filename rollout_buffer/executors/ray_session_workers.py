"""Session workers on a Ray cluster (`serve --executor ray --session-workers N`): each worker process runs on a
node of the cluster, started and watched by a small actor there (`WorkerHost`), so it can be placed by the
cluster's resources (`--session-worker-cpus`) and spread over nodes (worker k on the k-th node, round robin).

The actor starts `rollout-buffer session-worker` on its node (bound to the node's address, on a port it picked
once: a worker started again by the same actor keeps its port and its folder, so its sessions come back at the
same URL); the worker dies with its actor. The worker's secret and the server's token reach the actor in a method
call, and the worker in its environment: never an actor's constructor argument (Ray keeps those for as long as the
actor lives) nor a process argument. A lost actor (its node gone) is replaced by a new one, wherever the cluster
places it: its sessions are recorded failed (their journals were on the lost node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_buffer.config import ServerConfig
from rollout_buffer.executors.ray_pool import NAMESPACE, RayExecutor

log = logging.getLogger(__name__)


class WorkerHost:
    """A Ray actor running one session worker process on its node (plain class: the launcher makes it remote)."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._port: int | None = None

    async def start(self, args: list[str], secrets: dict[str, str], bind: str) -> tuple[str, int, int, str]:
        """Start `rollout-buffer session-worker` with `args`, killed with the actor even by SIGKILL (`setpriv`),
        bound as the buffer is (`bind`: `loopback`, `any`, else the node's address): the address agents reach it
        at, the port, the worker's pid, the Ray id of its node."""
        host = "127.0.0.1" if bind == "loopback" else _node_address()
        if self._port is None:
            self._port = _free_port(host)
        argv = [sys.executable, "-m", "rollout_buffer", "session-worker", *args, "--host",
                "0.0.0.0" if bind == "any" else host, "--port", str(self._port)]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        self._proc = await asyncio.create_subprocess_exec(*argv, env={**os.environ, **secrets},
                                                          start_new_session=True, stdin=asyncio.subprocess.DEVNULL)
        return host, self._port, self._proc.pid, ray.get_runtime_context().get_node_id()

    async def wait(self) -> int:
        """Return when the worker exits: its exit code."""
        assert self._proc is not None
        return await self._proc.wait()

    async def stop(self) -> None:
        """SIGTERM the worker (its sessions stay stored), then SIGKILL its group."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def _node_address() -> str:
    """The address of this actor's node as the cluster knows it (what `ray start --node-ip-address` set)."""
    node_id = ray.get_runtime_context().get_node_id()
    # ray (2.60) annotates neither `nodes()` nor the dicts it answers.
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return str(next(n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node_id))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class RayLauncher:
    """Starts session workers through `WorkerHost` actors on the Ray cluster the `ray` executor joins
    (`proxy.worker_launch.WorkerLauncher`)."""

    def __init__(self, config: ServerConfig, executor: RayExecutor):
        self.config = config
        self.buffer_url = config.buffer_url  # workers on other nodes reach the buffer at its public URL
        self._executor = executor
        # Workers listen as the buffer does: on loopback for a buffer on loopback (agents on the same machine),
        # on every interface for a wildcard `--host`, else on their node's address.
        loopback = config.host in ("127.0.0.1", "::1", "localhost")
        self._bind = "loopback" if loopback else "any" if config.host in ("0.0.0.0", "::", "") else "node"
        self._hosts: dict[int, Any] = {}
        self._remote: Any = None

    async def start(self, index: int, args: list[str], secrets: dict[str, str]
                    ) -> tuple[str, str, dict[str, Any]]:
        """Start worker `index` through its actor (a new actor when it has none, or lost it)."""
        await self._executor.connect()
        if self._remote is None:
            self._remote = ray.remote(WorkerHost)
        host = self._hosts.get(index)
        if host is None:
            nodes = await asyncio.to_thread(self._nodes)
            # Worker k on node k mod n: every node that can host one gets its share (Ray's SPREAD is best effort,
            # and so is a soft affinity). A node that dies meanwhile fails the start; the next try picks again.
            node = nodes[index % len(nodes)]
            log.info("session worker %d: starting on Ray node %s (%d of %d nodes)", index, node,
                     index % len(nodes) + 1, len(nodes))
            where = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            options = {"num_cpus": self.config.session_worker_cpus, "name": f"session-worker-{os.getpid()}-{index}",
                       "namespace": NAMESPACE, "scheduling_strategy": where}
            host = self._hosts[index] = self._remote.options(**options).remote()
        try:
            address, port, pid, node_id = await host.start.remote(args, secrets, self._bind)
        except RayActorError:
            self._hosts.pop(index, None)
            raise
        url = f"http://{f'[{address}]' if ':' in address else address}:{port}"
        return url, url, {"pid": pid, "node": address, "node_id": node_id}

    def _nodes(self) -> list[str]:
        """The ids of the alive nodes with the CPUs a worker reserves, in a stable order; RuntimeError naming the
        option when there is none (Ray would wait for one forever)."""
        want = self.config.session_worker_cpus
        # ray (2.60) annotates neither `nodes()` nor the dicts it answers.
        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        alive = [n for n in nodes if n.get("Alive")]
        fits = sorted(str(n["NodeID"]) for n in alive if float(n.get("Resources", {}).get("CPU", 0)) >= want)
        if not fits:
            most = max((float(n.get("Resources", {}).get("CPU", 0)) for n in alive), default=0.0)
            raise RuntimeError(f"--session-worker-cpus {want:g}: no node of the Ray cluster has that many CPUs (the "
                               f"largest has {most:g}); the buffer tries again, serving with the workers it has")
        return fits

    async def wait(self, index: int) -> int | None:
        """The worker's exit code; None when its actor (or node) is gone, which a new actor replaces."""
        try:
            code: int = await self._hosts[index].wait.remote()
            return code
        except RayActorError as e:
            log.warning("session worker %d: its Ray actor was lost (%s); a new one replaces it", index, e)
            self._hosts.pop(index, None)
            return None

    async def stop(self, index: int) -> None:
        """Stop the worker, then its actor."""
        host = self._hosts.pop(index, None)
        if host is None:
            return
        try:
            await host.stop.remote()
        except RayActorError:
            pass
        ray.kill(host)

    async def aclose(self) -> None:
        """The actors were stopped with their workers."""
