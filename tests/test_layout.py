"""The house's plan holds: imports only go down the stage order (docs/explanation/architecture.md, "The stage
order"), no import cycle among the project's modules, the serving side (docs/explanation/architecture.md, "The torch
line") imports without torch, and an install puts one package, `elmo`, into site-packages. The development
benchmarks (bench/, not installed) are checked too: they may import anything, nothing installed imports them."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# folder -> the dotted name an install gives it (pyproject.toml's package-dir): one package, `elmo`
PACKAGES = {"elmo": "elmo", "service": "elmo.service", "export": "elmo.export"}
# folder -> dotted name of the development folders: run from a checkout (`python -m bench.service.latency`), never
# installed; their modules are checked with the project's (stages, cycles, size) but kept out of the wheel
LAB = {"bench": "bench"}
# The stages, lowest first: a module may import its own stage and the ones before it, never a later one. The runtime
# sits low because both sides stand on it: export verifies through it and training reads model directories with it.
# Export sits below training and the importers: it turns any model directory into ONNX, and `elmo adapt` and
# `elmo pull` end by exporting the directory they produced.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    (
        "core",
        (
            "elmo",
            "elmo.errors",
            "elmo.text",
            "elmo.embedding",
            "elmo.wire",
            "elmo.significance",
            "elmo.model.config",
            "elmo.senses",
        ),
    ),
    ("runtime", ("elmo.runtime",)),
    ("model", ("elmo.model",)),
    ("export", ("elmo.export",)),
    ("train", ("elmo.train", "elmo.importers")),
    ("tasks", ("elmo.mix",)),
    ("callers", ("elmo.service", "elmo.batch", "elmo.client", "elmo.backends", "elmo.features", "elmo.spacy")),
    ("commands", ("elmo.cli", "elmo.bench")),
    ("lab", ("bench",)),  # last: the benches may import any stage, no installed module may import them
]
TORCH_FREE = [
    "elmo.text.chars",
    "elmo.text.tokenize",
    "elmo.model.config",
    "elmo.runtime",
    "elmo.runtime.modeldir",
    "elmo.runtime.tasks",
    "elmo.batch.cli",
    "elmo.batch.ray_engine",
    "elmo.client",
    "elmo.backends",
    "elmo.sizes",
    "elmo.wire",
    "elmo.features",
    "elmo.cli",
    "elmo.service.server",
]


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages and development folders (generated protobuf
    code left out)."""
    found = {}
    for folder, dotted in (PACKAGES | LAB).items():
        for path in (root / folder).rglob("*.py"):
            parts = (*dotted.split("."), *path.relative_to(root / folder).with_suffix("").parts)
            if "v1" in parts:
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (function-level imports included)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def stage_of(module: str) -> int:
    """The index in STAGES of the longest prefix that names ``module``'s stage."""
    best = max(
        (
            (len(prefix), index)
            for index, (_, prefixes) in enumerate(STAGES)
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        default=None,
    )
    assert best is not None, f"{module} belongs to no stage: add it to STAGES (and docs/explanation/architecture.md)"
    return best[1]


def imports_up_the_pipeline(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a later stage's module, as 'importer (stage) -> imported (stage)'."""
    name = [stage for stage, _ in STAGES]
    return sorted(
        f"{module} ({name[stage_of(module)]}) -> {target} ({name[stage_of(target)]})"
        for module, targets in graph.items()
        for target in targets
        if stage_of(target) > stage_of(module)
    )


def test_the_stage_checker_catches_an_import_up_the_pipeline():
    """Before issue 30 the biLM imported the training vocabulary (model -> train); the checker names such an import."""
    graph = {"elmo.model.bilm": {"elmo.train.vocab", "elmo.model.config"}, "elmo.train.vocab": {"elmo.text.chars"}}
    assert imports_up_the_pipeline(graph) == ["elmo.model.bilm (model) -> elmo.train.vocab (train)"]
    assert imports_up_the_pipeline({"elmo.train.loop": {"elmo.model.bilm"}}) == []
    lab = {"elmo.bench.run": {"bench.kit.texts"}, "bench.kit.load": {"elmo.bench.figures", "elmo.service.server"}}
    assert imports_up_the_pipeline(lab) == ["elmo.bench.run (commands) -> bench.kit.texts (lab)"]


def test_the_benches_are_checked_and_not_installed():
    """bench/ is in the checks (its kit and a script of each subject), `elmo bench` and its figures are installed,
    and nothing maps bench/ into the package."""
    modules = project_modules()
    assert {"bench.kit.serve", "bench.kit.load", "bench.service.latency", "bench.batch.throughput"} <= set(modules)
    assert {"elmo.bench.run", "elmo.bench.figures"} <= set(modules)
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not any(name == "bench" or name.startswith("bench.") for name in config["packages"])
    assert "bench" not in config["package-dir"].values()


def test_imports_only_go_down_the_pipeline():
    assert imports_up_the_pipeline(import_graph(project_modules())) == []


# The service's parts, lowest first (docs/explanation/architecture.md, "Service"): a part may import its own and
# earlier ones;
# the two doors stand side by side and never import each other.
SERVICE_PARTS = [
    ("common",),
    ("telemetry",),
    ("models",),
    ("core",),
    ("grpc", "http"),
    ("config",),
    ("processes",),
    ("server",),
]


def service_part(module: str) -> tuple[int, str]:
    """(rank in SERVICE_PARTS, part name) of an ``elmo.service.*`` module."""
    part = module.removeprefix("elmo.service.").split(".")[0]
    rank = next((i for i, names in enumerate(SERVICE_PARTS) if part in names), None)
    assert rank is not None, f"{module}: its part '{part}' is not in SERVICE_PARTS (and docs/explanation/...)"
    return rank, part


def service_imports_against_the_parts(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a later part, or of the other door, as 'importer -> imported'."""
    wrong = []
    for module, targets in graph.items():
        if not module.startswith("elmo.service."):
            continue
        rank, part = service_part(module)
        for target in targets:
            if target.startswith("elmo.service.") and target != "elmo.service":
                their_rank, theirs = service_part(target)
                if their_rank > rank or (their_rank == rank and theirs != part):
                    wrong.append(f"{module} -> {target}")
    return sorted(wrong)


TRAINING_SIDE = ("elmo.mix", "elmo.train", "elmo.importers", "elmo.model.bilm", "elmo.model.checkpoint")


def training_imports_of_the_serving_path(graph: dict[str, set[str]]) -> list[str]:
    """Training-side modules an ``elmo.service`` module reaches through its imports (at any depth)."""
    found = set()
    for module in (m for m in graph if m.startswith("elmo.service")):
        seen, todo = set(), [module]
        while todo:
            for target in graph.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        found |= {f"{module} -> {t}" for t in seen if t.startswith(TRAINING_SIDE)}
    return sorted(found)


def test_the_serving_path_reads_tasks_beside_the_runtime_not_from_a_training_package():
    assert training_imports_of_the_serving_path(import_graph(project_modules())) == []
    graph = {"elmo.service.models.tasks": {"elmo.runtime.tasks"}, "elmo.runtime.tasks": {"elmo.mix.modules"}}
    assert training_imports_of_the_serving_path(graph) == ["elmo.service.models.tasks -> elmo.mix.modules"]


def test_the_service_parts_import_only_down():
    assert service_imports_against_the_parts(import_graph(project_modules())) == []
    checked = {
        "elmo.service.core.requests": {"elmo.service.http.encodings"},
        "elmo.service.grpc.admin": {"elmo.service.http.app"},
        "elmo.service.http.app": {"elmo.service.core.requests", "elmo.service.common.errors"},
    }
    assert service_imports_against_the_parts(checked) == [
        "elmo.service.core.requests -> elmo.service.http.encodings",
        "elmo.service.grpc.admin -> elmo.service.http.app",
    ]


def test_an_install_holds_one_package_and_every_folder_of_it():
    """pyproject.toml lists every package directory, each under `elmo` (the folders service/ and export/ mapped
    into it), so a wheel has all the code and no generic top-level name."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert all(name == "elmo" or name.startswith("elmo.") for name in listed)
    assert config["package-dir"] == {dotted: folder for folder, dotted in PACKAGES.items() if folder != dotted}
    on_disk = {
        ".".join((*dotted.split("."), *init.parent.relative_to(REPO / folder).parts))
        for folder, dotted in PACKAGES.items()
        for init in (REPO / folder).rglob("*.py")
    }
    assert listed == on_disk


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(import_graph(project_modules())) == []


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_serving_side_imports_no_torch(module):
    code = f"import sys, {module}; sys.exit(2 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{module} imported torch\n{result.stderr}"


def test_the_wheel_puts_only_elmo_into_site_packages(tmp_path):
    """A real wheel, built from a copy of the sources (nothing written into the checkout): its only top-level
    package is `elmo`, and the mapped folders and package data are inside it."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in PACKAGES:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"elmo"}
    assert not any(name.startswith("elmo/bench/") and name.split("/")[2] in ("service", "kit") for name in names)
    for inside in (
        "elmo/service/server.py",
        "elmo/service/http/page/index.html",
        "elmo/export/onnx_export.py",
        "elmo/bench/run.py",
        "elmo/senses/en.tsv",
        "elmo/v1/embedder_pb2.py",
    ):
        assert inside in names
