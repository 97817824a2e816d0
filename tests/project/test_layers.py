"""The package's layers, in the order of the layout table of docs/architecture.md: a module may import from its own layer and
the layers above it (earlier rows), never from a layer below.

Every module's imports are read from its source with ``ast`` (module-level and function-level ``import`` and
``from ... import``, relative ones resolved), so a deferred import inside a function counts like any other.
The seams between the layers are checked the same way: the framework adapters use only the hook's public
surface, the Megatron-LM patch set calls only exported call sites, and the rules an adapter needs (default
output directory, the run's sinks, the evaluation steps, the integer check) each have one home.
"""
import ast
import re
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron_mech"

# The "Layout" rows of docs/architecture.md, top to bottom; each entry names a sub-package or a top-level module.
LAYERS = [
    ("core",),
    ("monitors",),
    ("records",),
    ("config", "options"),
    ("hook", "model_view", "optim", "logs", "extension"),
    ("adapters",),
    ("trainers",),
    ("studies",),
    ("cli", "references"),
]
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}

# The studies reach the product through the hook's extension seam (``megatron_mech.hook.Extension``), registered by
# the entry points: no module imports from a layer below its own.


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str):
    """The layer of a ``megatron_mech`` module (``None`` for anything outside the package). The package root
    (``megatron_mech/__init__.py``, the core's lazily loaded names) counts as the core."""
    parts = module.split(".")
    if parts[0] != "megatron_mech":
        return None
    if len(parts) == 1:
        return LAYER_OF["core"]
    if parts[1] not in LAYER_OF:
        raise AssertionError(f"{module}: not in any layer; add it to LAYERS in the order of docs/architecture.md")
    return LAYER_OF[parts[1]]


def imported_modules(path: Path, module: str):
    """Every module ``path`` imports, anywhere in its body, as absolute names. ``from X import a`` yields
    ``X.a`` too when that is a module (a sub-package's module imported by name)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target
            for alias in node.names:
                candidate = target + "." + alias.name
                relative = Path(*candidate.split("."))
                if (REPO_ROOT / relative).with_suffix(".py").is_file() or (REPO_ROOT / relative).is_dir():
                    yield candidate


def layer_violations():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = layer(module)
        for target in imported_modules(path, module):
            other = layer(target)
            if other is not None and other > own:
                found.add((module, target))
    return found


def test_every_module_is_in_a_layer_and_the_scan_sees_function_level_imports():
    # the scan must see what it polices: the hook's evaluation imports the pipeline-stage exchange inside a method
    evaluation = PACKAGE / "hook" / "step_evaluation.py"
    assert "megatron_mech.core.metric_exchange" in set(imported_modules(evaluation, "megatron_mech.hook.step_evaluation"))
    for path in PACKAGE.rglob("*.py"):
        layer(module_name(path))  # raises for a module outside every layer


def test_no_module_imports_from_a_layer_below_it():
    violations = sorted(layer_violations())
    assert not violations, "imports from a lower layer of the layout table (docs/architecture.md):\n" + "\n".join(
        f"  {module} imports {target}" for module, target in violations)


def test_the_scan_finds_an_import_from_a_lower_layer(tmp_path):
    # the reference: a product module that imports the studies, as the hook once did for the fault injector
    planted = tmp_path / "hook.py"
    planted.write_text("def build():\n    from megatron_mech.studies.injectors import FaultInjector\n")
    targets = set(imported_modules(planted, "megatron_mech.hook"))
    assert "megatron_mech.studies.injectors" in targets
    assert layer("megatron_mech.studies.injectors") > layer("megatron_mech.hook")


# The packages that drive the hook from outside it: the framework adapters and the reference trainers.
HOOK_USERS = ("adapters", "trainers")


def private_hook_accesses(root: Path):
    """``x._name`` in the adapters and trainers where ``x`` is the hook or the MoLS backend it holds (``hook``,
    ``self.hook``, ``RUN.hook``, ``get_hook()``, ``mols``, ``hook.mols``, ...): they must manage with the hook's
    public surface."""
    found = []
    for package in HOOK_USERS:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                        and not node.attr.startswith("__")):
                    continue
                names = set(re.findall(r"[A-Za-z_]\w*", ast.unparse(node.value)))
                if names & {"hook", "get_hook", "mols"}:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: "
                                 f"{ast.unparse(node.value)}.{node.attr}")
    return found


def test_adapters_and_trainers_use_only_the_hooks_public_surface():
    assert not private_hook_accesses(PACKAGE)


def test_the_patch_set_calls_only_the_call_sites_public_functions():
    """Every ``mech_callsites.<name>`` a Megatron-LM patch adds is a public, exported call site."""
    from megatron_mech.adapters.megatron_lm_fork import callsites

    patches = PACKAGE / "adapters" / "megatron_lm_fork" / "patches"
    called = {name for path in patches.rglob("*.patch")
              for name in re.findall(r"mech_callsites\.(\w+)", path.read_text())}
    assert len(called) >= 10  # the scan found the call sites (13 in every series today)
    assert called <= set(callsites.__all__), sorted(called - set(callsites.__all__))
    assert all(callable(getattr(callsites, name)) for name in called)


def calls_and_strings(root: Path):
    """``(file, kind, value)`` for every function called by name and every string constant under ``root``."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                yield path.relative_to(root.parent).as_posix(), "call", name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield path.relative_to(root.parent).as_posix(), "string", node.value


def evaluation_rule_homes(root: Path = REPO_ROOT) -> set:
    """The files under ``root`` (the package and the launchers) computing ``<step> % <the monitors' interval>``:
    a right operand named ``interval`` or ``mech_interval`` (Megatron's own ``log_interval``, ``save_interval``,
    ... are other rules)."""
    paths = [*(root / "megatron_mech").rglob("*.py"), *(root / "launch_scripts").rglob("*.py")]
    return {path.relative_to(root).as_posix() for path in paths
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
            and re.search(r"(^|\.)(mech_)?interval$", ast.unparse(node.right))}


def test_the_evaluation_rule_scan_finds_a_second_home(tmp_path):
    # the reference: the launcher's own rule as it was, and the attention monitor's
    (tmp_path / "launch_scripts").mkdir()
    (tmp_path / "megatron_mech" / "monitors").mkdir(parents=True)
    (tmp_path / "launch_scripts" / "train.py").write_text("ok = engine.global_steps % args.mech_interval == 0\n")
    (tmp_path / "megatron_mech" / "monitors" / "m.py").write_text(
        "if step % self.config.interval:\n    pass\nlog = step % args.log_interval\n")
    assert evaluation_rule_homes(tmp_path) == {"launch_scripts/train.py", "megatron_mech/monitors/m.py"}


@pytest.mark.slow
def test_the_output_evaluation_and_int_rules_have_one_home():
    """The default output directory is one constant (``config.DEFAULT_OUTPUT_DIR``), chosen over the configured and
    the checkpoint directory by one function (``config.output_directory``); the run's sinks are built
    in one place (``MechHook.open_sinks``, through the hook's record writer), the evaluation steps decided in one (``core.schedule.is_evaluation_step``:
    no ``step % interval`` anywhere else in the package or the launchers) and "an int, not a bool" checked by one
    function (``core.checks.is_int``)."""
    found = [*calls_and_strings(PACKAGE), *calls_and_strings(REPO_ROOT / "launch_scripts")]
    assert {f for f, kind, value in found if kind == "string" and "runs/mech" in value} == {"megatron_mech/config.py"}
    falling_back = {path.relative_to(REPO_ROOT).as_posix() for path in PACKAGE.rglob("*.py")
                    if "or DEFAULT_OUTPUT_DIR" in path.read_text()}
    assert falling_back == {"megatron_mech/config.py"}, falling_back  # the fallback rule is output_directory's
    assert {f for f, kind, value in found if kind == "call" and value == "default_sinks"} == {"megatron_mech/hook/record_writer.py"}
    assert evaluation_rule_homes() == {"megatron_mech/core/schedule.py"}
    int_checks = {path.relative_to(REPO_ROOT).as_posix() for path in PACKAGE.rglob("*.py")
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "is_int"}
    assert int_checks == {"megatron_mech/core/checks.py"}  # the one "int, not bool" check


def import_loops(root: Path = PACKAGE):
    """The import loops among the modules under ``root``: strongly connected groups of more than one module of
    the graph "module → every package module it imports, anywhere in its body". A package's ``__init__`` that
    only re-exports its own submodules is not an edge back from them (they never import it)."""
    modules = {module_name(path): path for path in sorted(root.rglob("*.py"))}
    graph = {m: sorted({t for t in imported_modules(p, m) if t in modules and t != m}) for m, p in modules.items()}
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return loops


def test_no_import_loop_in_the_package():
    loops = import_loops()
    assert not loops, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(group) for group in loops)


def test_the_loop_scan_finds_a_loop(tmp_path, monkeypatch):
    package = tmp_path / "megatron_mech" / "studies"
    package.mkdir(parents=True)
    (package / "a.py").write_text("def f():\n    from megatron_mech.studies.b import g\n")
    (package / "b.py").write_text("from megatron_mech.studies import a\n")
    (package / "c.py").write_text("from megatron_mech.studies.a import f\n")
    monkeypatch.setattr(__import__(__name__), "REPO_ROOT", tmp_path)
    assert import_loops(tmp_path / "megatron_mech") == [["megatron_mech.studies.a", "megatron_mech.studies.b"]]
