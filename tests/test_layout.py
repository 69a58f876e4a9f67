"""The package layout stays true: no import circles, imports run one way between the rooms.

Reads the sources with `ast` (nothing is imported), so a function-level import counts like a top-level one:
either kind can close a circle at run time or make a lower room depend on a higher one.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "rollout_buffer"

# What each room may import of the service, besides itself. `tools` and the re-exporting modules at the top
# may import anything; nothing below them may import them.
ALLOWED: dict[str, set[str]] = {
    # What the operator lets clients name (`--policy`, `--allow-*`): nothing of the service.
    "policy": set(),
    # Images a trajectory saw (decoding, fetching from allowed hosts, the content-hashed store, placeholder counts).
    "media": {"policy"},
    "config": {"policy", "media"},
    "schemas": {"policy"},
    # Starting and ending child processes (environments, agents' commands, session workers): nothing of the service.
    "processes": set(),
    "observability": set(),
    # The time timers read: nothing of the service.
    "clock": set(),
    # Shortcuts around dependencies' public APIs: nothing of the service.
    "shortcuts": set(),
    "delivery": {"policy", "config", "schemas", "observability", "media"},
    # The SGLang engine client: nothing of runs, records or tokens.
    "engine": {"policy", "observability"},
    "tokens": {"observability", "delivery", "engine", "shortcuts", "media"},
    "generation": {"policy", "config", "schemas", "observability", "delivery", "engine", "tokens", "media"},
    "proxy": {"policy", "config", "schemas", "observability", "delivery", "engine", "tokens", "generation",
              "processes", "shortcuts", "media", "clock"},
    # Executors run trajectories elsewhere (Ray actors) with the generator API; the server picks one.
    "executors": {"policy", "config", "schemas", "observability", "delivery", "engine", "tokens", "generation"},
    "server": {"policy", "config", "schemas", "observability", "delivery", "engine", "tokens", "generation", "proxy",
               "executors", "shortcuts", "media"},
    # Environments in their own processes: the buffer's side knows nothing of the service.
    "environments": {"processes"},
}
TOP = {"tools", "__main__", "generator_api"}
# Inside delivery, storage by concern: the store thread knows only the schema; each concern is a module over the
# store (streams are what completion admits groups to and what reads join); only the buffer composes them.
DELIVERY: dict[str, set[str]] = {
    "schema": {"record_images"},
    "record_images": set(),
    "store": {"schema"},
    "groups": set(),
    "versions": set(),
    "runs": {"store"},
    "side_data": set(),
    "record_layout": {"side_data"},
    "streams": {"store", "groups", "versions", "record_layout"},
    "records": {"store", "groups", "streams", "versions", "record_layout", "record_images"},
    "reads": {"store", "streams"},
    "evals": {"store"},
    "retention": {"store", "encoded", "record_layout", "record_images"},  # the app runs it beside the buffer
    "queries": {"record_layout"},
    "ledger": {"streams", "versions"},
    # A record as the store takes it, made where it is built.
    "encoded": {"records", "streams", "versions", "record_layout", "side_data", "record_images"},
    "buffer": {"store", "groups", "versions", "runs", "streams", "records", "reads", "evals", "ledger", "encoded"},
}
# The core never names the packages that sit beside it: generators are found by discovery, the slime adapter
# speaks HTTP only, the simulated engine is a process the demo and the tests start.
OUTSIDE = ("generators", "slime_adapter", "rollout_sim")
SIMULATOR = "rollout_sim"
# What the simulator may take from the service: the bundled tokenizer and the vision processor's placeholder counts,
# which the engine it imitates computes too.
SIMULATOR_USES = {"rollout_buffer.tokens.tokenizer", "rollout_buffer.media.vision"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """Modules `name` imports, resolved to the most specific module that exists (`from a import b` where b
    is a module counts as importing `a.b`)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in known else base


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    known = set(modules)
    return {name: set(_imports(name, path, known)) for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _allowed(source: str, target: str) -> bool:
    src, dst = _room(source), _room(target)
    if src in TOP or src == dst or dst == "":
        return True
    if dst in TOP:
        return False
    allowed = ALLOWED[src]
    rest = target.split(".", 1)[1]
    return dst in allowed or any(rest == a or rest.startswith(a + ".") for a in allowed)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph restricted to edges between the package's own modules (packages' `__init__` excluded as
    targets: importing `a.b` runs `a/__init__`, whose docstring-only body imports nothing)."""
    return {m: {t for t in targets if t in graph and t != m.rsplit(".", 1)[0]} for m, targets in graph.items()}


def test_the_checker_sees_a_circle_and_a_wrong_direction() -> None:
    graph = {"rollout_buffer.delivery.a": {"rollout_buffer.generation.b"},
             "rollout_buffer.generation.b": {"rollout_buffer.delivery.a"}}
    assert _cycles(graph) == [["rollout_buffer.delivery.a", "rollout_buffer.generation.b"]]
    assert not _allowed("rollout_buffer.delivery.a", "rollout_buffer.generation.b")
    assert _allowed("rollout_buffer.generation.b", "rollout_buffer.delivery.a")
    assert not _allowed("rollout_buffer.observability.metrics", "rollout_buffer.generation.runner")
    assert not _allowed("rollout_buffer.generation.runner", "rollout_buffer.tools.demo")
    assert not _allowed("rollout_buffer.generation.runner", "rollout_buffer.executors.ray_pool")
    assert _allowed("rollout_buffer.executors.ray_worker", "rollout_buffer.generation.trajectory")


def test_no_import_circles() -> None:
    graph = internal(_graph(PACKAGE))
    assert len(graph) > 30, "the walk found the package's modules"
    assert _cycles(graph) == []


def test_imports_run_one_way_between_rooms() -> None:
    graph = internal(_graph(PACKAGE))
    wrong = sorted((src, dst) for src, targets in graph.items() for dst in targets if not _allowed(src, dst))
    assert wrong == [], "imports against the layout (see ALLOWED): " + ", ".join(f"{s} -> {d}" for s, d in wrong)


def test_every_room_is_known_and_says_what_it_holds() -> None:
    rooms = {p.parent.name for p in (ROOT / PACKAGE).glob("*/__init__.py")}
    modules = {"policy", "config", "schemas", "processes", "clock", "__main__", "generator_api"}
    assert rooms == (set(ALLOWED) | TOP) - modules
    for room in rooms:
        doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / room / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{room}/__init__.py says what lives there and what it may import"
    assert {p.stem for p in (ROOT / PACKAGE).glob("*.py")} == modules | {"__init__"}


def test_delivery_keeps_storage_by_concern() -> None:
    graph = internal(_graph(PACKAGE))
    room = f"{PACKAGE}.delivery."
    modules = {m.removeprefix(room) for m in graph if m.startswith(room)}
    assert modules == set(DELIVERY), "every delivery module has its place in DELIVERY"
    wrong = sorted((src, dst) for src in modules for dst in (t.removeprefix(room) for t in graph[room + src]
                                                              if t.startswith(room)) if dst not in DELIVERY[src])
    assert wrong == [], f"delivery modules importing against DELIVERY: {wrong}"


def test_no_module_of_the_service_outgrows_one_concern() -> None:
    """A module over ~500 lines is doing more than one job; beside the service, 600 is the bound."""
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules(PACKAGE).items()}
    assert {m: n for m, n in sizes.items() if n > 520} == {}, "split these by concern"
    beside = {m: len(p.read_text().splitlines())
              for package in (SIMULATOR, *OUTSIDE, "bench") for m, p in _modules(package).items()}
    assert {m: n for m, n in beside.items() if n > 600} == {}, "split these by concern"


def test_no_function_outgrows_one_screen() -> None:
    """A function over 80 lines (a nest of closures, a handler doing three things) is split by concern."""
    long = []
    for package in (PACKAGE, *OUTSIDE, "bench"):
        for module, path in _modules(package).items():
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                    if node.end_lineno - node.lineno + 1 > 80:
                        long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == [], "split these by concern"


def test_the_simulator_stands_outside_the_service_and_uses_only_what_the_engine_computes_too() -> None:
    assert not (ROOT / PACKAGE / "sim").exists()
    graph = _graph(SIMULATOR)
    assert len(graph) > 5, "the walk found the simulator's modules"
    assert _cycles(internal(graph)) == []
    used = {dst for targets in graph.values() for dst in targets if dst.split(".")[0] == PACKAGE}
    assert used <= SIMULATOR_USES, f"the simulator imports {sorted(used - SIMULATOR_USES)} of the service"
    service = _graph(PACKAGE)
    assert not [(s, d) for s, targets in service.items() for d in targets if d.split(".")[0] == SIMULATOR], \
        "the service (its CLI included) starts the simulator as a process, by module name"


def test_the_core_never_imports_generators_or_the_adapter() -> None:
    graph = _graph(PACKAGE)
    offending = sorted(
        (src, dst) for src, targets in graph.items() if _room(src) not in TOP
        for dst in targets if dst.split(".")[0] in OUTSIDE
    )
    assert offending == []


def test_the_adapter_speaks_http_only_and_generators_use_the_generator_api() -> None:
    adapter = _graph("slime_adapter")
    assert not {d for targets in adapter.values() for d in targets if d.split(".")[0] == PACKAGE}
    core = _modules(PACKAGE)
    for src, targets in _graph("generators").items():
        for dst in (t for t in targets if t.split(".")[0] == PACKAGE):
            assert dst in core, f"{src} imports {dst}, which does not exist"
            assert dst == f"{PACKAGE}.generator_api", f"{src} -> {dst}: generators import the generator API only"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("rollout_buffer.tools.demo", "bundled_dataset"),
        ("rollout_buffer.tokens.tokenizer", "bundled_tokenizer_path"),
        ("rollout_buffer.generator_api", "RolloutContext"),
        ("rollout_buffer.generator_api", "Conversation"),
        ("rollout_buffer.generator_api", "EngineError"),
        ("rollout_buffer.tools.cli", "main"),
        ("slime_adapter", "generate_rollout"),
    ],
)
def test_public_import_paths_keep_working(module: str, name: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None
    assert callable(getattr(importlib.import_module(module), name))



def test_test_modules_share_helpers_through_helper_modules_not_each_other() -> None:
    tests = ROOT / "tests"
    crossing = sorted((path.name, imported) for path in tests.glob("test_*.py")
                      for imported in _imports(path.stem, path, set()) if imported.startswith("test_"))
    assert crossing == [], "move what test modules share into a helper module (tests/*.py without test_)"


# What a tier's modules may not import (tests/tiers.py): processes and servers are the system tier's.
PROCESS_HELPERS = {"servers", "sim_engine_process", "demo_cli", "ops_helpers", "readable", "ray_cluster",
                   "environment_venvs", "agent_files", "subprocess", "multiprocessing", "playwright", "ray", "psutil"}
NOT_IN_TIER = {"unit": PROCESS_HELPERS | {"socket", "uvicorn"}, "service": PROCESS_HELPERS, "system": set()}


def test_every_test_module_has_a_tier_and_imports_only_what_it_allows() -> None:
    from tiers import SERVICE, UNIT, tier_of

    tests = ROOT / "tests"
    modules = {p.stem: p for p in tests.glob("test_*.py")}
    assert (UNIT | SERVICE) <= set(modules), "the tiers name modules that exist"
    wrong = sorted((name, tier_of(name), imported) for name, path in modules.items()
                   for imported in {i.split(".")[0] for i in _imports(name, path, set())}
                   if imported in NOT_IN_TIER[tier_of(name)])
    assert wrong == [], "a module whose tests start processes or servers belongs to a slower tier (tests/tiers.py)"
