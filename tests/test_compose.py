"""docker-compose.yml and docker/Dockerfile: structure, and every command they run, run for real on loopback.

There is no Docker engine on the build machines: the compose file is read as YAML with its `${VAR:-default}`
defaults applied, and each rollout-buffer service's command is started as `python -m rollout_buffer`
with the container's paths and ports mapped to local ones, then probed with the service's own healthcheck.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from servers import free_port, running

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path
from rollout_buffer.tools.cli import DELEGATED

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PROBE = ROOT / "docker" / "healthcheck.py"
DEFAULT_SERVICES = {"buffer", "router", "sim-engine", "retriever"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
# What the stack needs set (compose refuses to start without it): the buffer's token.
REQUIRED_ENV = {"ROLLOUT_BUFFER_AUTH_TOKEN": "t0ken"}


class Unset(ValueError):
    """A `${VAR:?message}` variable compose would refuse to start without."""


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution: `${VAR}`, `${VAR:-default}` (unset or empty), `${VAR-default}` (unset),
    `${VAR:?message}` (required: Unset with the message when unset or empty)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, str):
        def sub(m: re.Match[str]) -> str:
            name, op, default = m.group(1), m.group(2), m.group(3) or ""
            if op in (":?", "?") and not env.get(name):
                raise Unset(f"{name}: {default}")
            if op in (":?", "?"):
                return env[name]
            if op == ":-":
                return env.get(name) or default
            return env.get(name, default) if op == "-" else env.get(name, "")
        return _VAR.sub(sub, node)
    return node


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), {**REQUIRED_ENV, **(env or {})})


def test_the_stack_does_not_start_the_buffer_without_a_token() -> None:
    with pytest.raises(Unset, match="ROLLOUT_BUFFER_AUTH_TOKEN"):
        interpolate(yaml.safe_load(COMPOSE.read_text()), {})
    buffer = load_compose()["services"]["buffer"]
    assert buffer["environment"]["ROLLOUT_BUFFER_AUTH_TOKEN"] == REQUIRED_ENV["ROLLOUT_BUFFER_AUTH_TOKEN"]
    assert flag(argv(buffer), "--host") == "0.0.0.0"
    assert {argv(buffer)[i + 1] for i, a in enumerate(argv(buffer)) if a == "--data-root"} == {"/inputs", "/models"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def argv(service: dict[str, Any]) -> list[str]:
    """The service's command as argv (a string command is split the way compose splits it)."""
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def dockerfile_stages() -> dict[str, list[str]]:
    """Instructions of each named stage, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = stages.setdefault(m.group(1), [])
        current.append(line)
    return stages


def published_ports(service: dict[str, Any]) -> dict[int, int]:
    """container port → host port of `HOST_IP:HOST_PORT:CONTAINER_PORT` entries."""
    out = {}
    for entry in service.get("ports", []):
        *_, host, container = str(entry).split(":")
        out[int(container)] = int(host)
    return out


def probe_url(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[2] == "/opt/rollout-buffer/healthcheck.py", test
    return test[3]


# ---- structure ---------------------------------------------------------------------------------------


def test_default_stack_needs_no_gpu_and_the_sglang_worker_is_a_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == DEFAULT_SERVICES
    assert services["sglang"]["profiles"] == ["gpu"] and services["prometheus"]["profiles"] == ["monitoring"]
    for name in default:
        assert "deploy" not in services[name], f"{name} must start on a machine without GPUs"
    devices = services["sglang"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert services["sglang"]["image"].startswith("lmsysorg/sglang:")
    sglang = argv(services["sglang"])
    assert sglang[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(sglang, "--host") == "0.0.0.0" and flag(sglang, "--port") == "30000"
    assert flag(sglang, "--model-path").startswith("/models/")


def test_sglang_is_only_in_the_gpu_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = [re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert "sglang" not in base and "sglang-router" not in base
    assert any(d.startswith("sglang") for d in project["optional-dependencies"]["gpu"])
    installs = [line for lines in dockerfile_stages().values() for line in lines if "pip install" in line]
    assert all(re.findall(r"sglang[\w-]*", line) in ([], ["sglang-router"]) for line in installs), installs


def test_images_come_from_dockerfile_stages_or_pinned_registries(compose: dict[str, Any]) -> None:
    stages = dockerfile_stages()
    for name, service in compose["services"].items():
        assert service.get("image"), f"{name} has no image name"
        build = service.get("build")
        if build is None:
            assert ":" in service["image"], f"{name}: give the image a tag"
            continue
        assert (ROOT / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["target"] in stages, f"{name}: no stage {build['target']!r} in {DOCKERFILE}"
    assert compose["services"]["router"]["build"]["target"] == "router"
    assert {compose["services"][s]["build"]["target"] for s in ("buffer", "sim-engine", "retriever")} == {"runtime"}


def test_ports_healthchecks_and_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    declared_volumes = set(compose["volumes"])
    for name, service in services.items():
        args = argv(service)
        listen = int(flag(args, "--port")) if "--port" in args else None
        if name not in ("prometheus", "ray-head"):  # ray-head: Ray's own flags, see its test
            assert "--host" in args and flag(args, "--host") == "0.0.0.0", f"{name} must listen beyond loopback"
            url = probe_url(service)
            assert re.match(rf"http://127\.0\.0\.1:{listen}/\w+$", url), f"{name}: healthcheck {url} vs port {listen}"
            assert {"interval", "timeout", "retries", "start_period"} <= set(service["healthcheck"])
        for container_port, host_port in published_ports(service).items():
            assert 0 < host_port < 65536
            assert container_port in (listen, 29000, 9090, 8265), f"{name}: {container_port} is not what it listens on"
        for volume in service.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            assert target.startswith("/"), volume
            if source.startswith("./"):
                if source.startswith("./docker/"):
                    assert (ROOT / source).is_file(), f"{name} mounts a missing file {source}"
            else:
                assert source in declared_volumes, f"{name}: volume {source} is not declared"
    # Ports the issue documents: buffer 8889 (slime's default), router 30000 + metrics 29000, retriever 8000.
    assert published_ports(services["buffer"]) == {8889: 8889}
    assert published_ports(services["router"]) == {30000: 30000, 29000: 29000}
    assert published_ports(services["retriever"]) == {8000: 8000}
    assert "buffer-data:/data" in services["buffer"]["volumes"]
    assert flag(argv(services["buffer"]), "--data-dir") == "/data"


def test_ray_head_is_an_optional_profile_the_buffer_can_join(compose: dict[str, Any]) -> None:
    from ray.scripts.scripts import start

    services = compose["services"]
    head = services["ray-head"]
    assert head["profiles"] == ["ray"] and head["entrypoint"] == ["ray"]
    assert head["build"]["target"] == "runtime", "actors import the buffer's generators: the same image"
    # Ray's own command line parses the command.
    params = start.make_context("start", argv(head)[1:]).params
    assert params["head"] and params["block"] and params["port"] == 6379 and params["dashboard_host"] == "0.0.0.0"
    assert probe_url(head) == f"http://127.0.0.1:{params['dashboard_port']}/api/gcs_healthz"
    assert published_ports(head) == {6379: 6379, 8265: 8265}
    buffer = argv(services["buffer"])
    assert flag(buffer, "--executor") == "local" and flag(buffer, "--ray-address") == "ray-head:6379"
    on_ray = load_compose({"BUFFER_EXECUTOR": "ray", "ROLLOUT_BUFFER_EXTRAS": "ray"})["services"]
    assert flag(argv(on_ray["buffer"]), "--executor") == "ray"
    assert on_ray["ray-head"]["build"]["args"] == {"EXTRAS": "ray"} and head["build"]["args"] == {"EXTRAS": ""}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("ray") for d in extras["ray"])


def test_every_variable_is_documented_in_the_header() -> None:
    text = COMPOSE.read_text()
    header = text[: text.index("\nname:")]
    used = set(_VAR.findall(text[len(header):]))
    for name in {m[0] for m in used}:
        assert name in header, f"${{{name}}} is used but not documented at the top of docker-compose.yml"


def test_router_sits_in_front_of_the_workers(compose: dict[str, Any]) -> None:
    from sglang_router.launch_router import parse_router_args

    services = compose["services"]
    router = parse_router_args(argv(services["router"]))
    assert router.worker_urls == ["http://sim-engine:30000"]
    assert router.host == "0.0.0.0" and router.port == 30000
    assert router.prometheus_host == "0.0.0.0" and router.prometheus_port == 29000
    assert flag(argv(services["sim-engine"]), "--port") == "30000"
    assert services["router"]["depends_on"]["sim-engine"]["condition"] == "service_healthy"
    assert services["router"]["depends_on"]["sglang"] == {"condition": "service_healthy", "required": False}
    assert probe_url(services["router"]).endswith("/readiness")
    # Several workers in one variable, as the header documents for the gpu profile.
    env = {"ROUTER_WORKER_URLS": "http://sglang:30000 http://10.0.0.7:30000", "ROUTER_POLICY": "round_robin"}
    gpu = parse_router_args(argv(load_compose(env)["services"]["router"]))
    assert gpu.worker_urls == ["http://sglang:30000", "http://10.0.0.7:30000"] and gpu.policy == "round_robin"


def test_prometheus_scrapes_the_buffer_and_the_router(compose: dict[str, Any]) -> None:
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"buffer:8889", "router:29000"}
    for target in targets:
        name, port = target.split(":")
        assert int(port) in published_ports(compose["services"][name])


def test_dockerfile_is_multi_stage_slim_and_non_root() -> None:
    stages = dockerfile_stages()
    assert list(stages)[-1] == "runtime", "a plain `docker build` must give the service image"
    assert {"base", "build", "router", "runtime"} <= set(stages)
    text = DOCKERFILE.read_text()
    assert not re.search(r"apt-get|build-essential|gcc|cargo|rustup", text), "no build tools in the images"
    for name in ("runtime", "router"):
        lines = stages[name]
        assert lines[0].split()[1] == "base"
        users = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0")
        assert any(line.startswith("HEALTHCHECK") for line in lines)
    runtime = " ".join(stages["runtime"])
    assert 'VOLUME ["/data"]' in runtime and "http://127.0.0.1:8889/healthz" in runtime
    assert 'ENTRYPOINT ["rollout-buffer"]' in runtime
    assert "COPY --from=build /opt/venv" in runtime and "pip install" not in runtime
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rollout-buffer"] == "rollout_buffer.tools.cli:main"
    router = " ".join(stages["router"])
    assert 'ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]' in router
    assert "30000/readiness" in router
    # Everything COPY takes from the build context exists and is let through .dockerignore.
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for line in text.splitlines():
        m = re.match(r"COPY\s+(?!--from)(\S+)\s+\S+$", line.strip())
        if m:
            for src in m.group(1).split():
                assert (ROOT / src).exists(), src
                assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is .dockerignored"


def test_health_probe_reports_failure() -> None:
    url = f"http://127.0.0.1:{free_port()}/healthz"
    result = subprocess.run([sys.executable, str(PROBE), url, "1"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "unhealthy" in result.stderr


# ---- every rollout-buffer command the stack runs, run ------------------------------------------------


def local_args(args: list[str], port: int, data_dir: Path) -> list[str]:
    """A container command on this machine: loopback, a free port, image paths mapped to the checkout."""
    image_paths = {
        "/opt/rollout-buffer/examples": str(ROOT / "generators" / "data"),
        "/opt/rollout-buffer/qwen3-tokenizer": bundled_tokenizer_path(),
        "/data": str(data_dir),
    }
    out = []
    for a in args:
        for image_path, local in image_paths.items():
            if a == image_path or a.startswith(image_path + "/"):
                a = local + a[len(image_path):]
        out.append(a)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


@pytest.mark.parametrize("service", sorted(DEFAULT_SERVICES - {"router"}))
def test_service_command_runs_and_passes_its_healthcheck(compose: dict[str, Any], service: str, tmp_path) -> None:
    spec = compose["services"][service]
    args = argv(spec)
    assert args[0] in DELEGATED or args[0] == "serve", f"`rollout-buffer {args[0]}` does not exist"
    dockerfile = DOCKERFILE.read_text()
    assert "/opt/rollout-buffer/examples" in dockerfile and "/opt/rollout-buffer/qwen3-tokenizer" in dockerfile
    port = free_port()
    listen = flag(args, "--port")
    health_path = "/" + probe_url(spec).split("/", 3)[3]
    with running(local_args(args, port, tmp_path / "data"), health_path, port, tmp_path / f"{service}.log"):
        url = probe_url(spec).replace(f":{listen}/", f":{port}/")
        # A proxy in the environment must not catch the probe's loopback request.
        probe = subprocess.run([sys.executable, str(PROBE), url], capture_output=True, timeout=30,
                               env={**os.environ, "http_proxy": "http://127.0.0.1:9"})
    assert probe.returncode == 0, probe.stderr
