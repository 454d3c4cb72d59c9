"""The contracts between processes are written once: the batch script's settings header equals the
environment table, and the layers import each other only the one way."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.contracts import env, jobdir, metrics
from raytrain.contracts.result import EXIT_CANCELLED, EXIT_LOST, EXIT_PREEMPTED, RunResult
from raytrain.recipe.metrics import EpochMetrics
from tests.conftest import REPO

SBATCH = REPO / "slurm" / "ray_cluster.sbatch"
PACKAGE = REPO / "raytrain"


def header_settings() -> list[tuple[str, str, str]]:
    """(name, meaning, default) of each setting the batch script's header documents."""
    rows = re.findall(r"^#   (RAYTRAIN_\w+)\s+(.+?)\s+\[(.*)\]$", SBATCH.read_text(), re.M)
    return [(n, m.strip(), d) for n, m, d in rows]


def test_sbatch_header_lists_exactly_the_settings_of_the_table() -> None:
    table = [(v.name, v.meaning, v.documented_default) for v in env.settings()]
    assert header_settings() == table, "regenerate the header from raytrain.contracts.env"


def test_sbatch_defaults_and_names_agree_with_the_contracts() -> None:
    text = SBATCH.read_text()
    for name, default in re.findall(r"\$\{(RAYTRAIN_\w+):-([^}]*)\}", text):
        var = next(v for v in env.TABLE if v.name == name)
        assert default == var.default, (name, default, var.default)
    # The exit statuses come from `launch setup` (raytrain.contracts.result), not from a second copy here;
    # the header that tells users about them says what the contract says.
    header, code = text.split("set -euo pipefail", 1)
    assert not re.search(rf"\b({EXIT_PREEMPTED}|{EXIT_LOST})\b", code)
    assert f"exits with {EXIT_PREEMPTED} " in header and f"(exit {EXIT_LOST})" in header
    assert set(re.findall(r"\b(7\d)\b", header)) == {str(EXIT_PREEMPTED), str(EXIT_LOST)}
    # Every Slurm command is run from Python (raytrain.slurm_env: bounded, one policy): none in the script's code.
    code = [re.sub(r"(^|\s)#(\s.*)?$", "", line) for line in text.splitlines()]
    slurm_calls = re.compile(r"\b(squeue|scancel|scontrol|srun|sbatch|sinfo|sacct)\b")
    assert "launch stop-steps" in text and [ln for ln in code if slurm_calls.search(ln)] == []
    assert f"#SBATCH --signal=B:USR2@{env.SIGNAL_LEAD.default}\n" in text  # the lead the time-limit check assumes
    assert '"${py}" -m raytrain.launch step --role "${role}"' in text  # the step names: raytrain.launch.steps
    # Every RAYTRAIN_ variable the script reads or sets is in the table.
    for name in set(re.findall(r"\b(RAYTRAIN_[A-Z_]+)\b", text)):
        assert any(v.name == name for v in env.TABLE), name


def test_python_reads_raytrain_variables_only_through_the_table() -> None:
    bare = re.compile(r"""(environ|getenv)(?:\.(?:get|pop|setdefault))?\s*[(\[]\s*["'](RAYTRAIN_|RAY_)""")
    offenders = [
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        if path.name != "env.py" and bare.search(path.read_text())
    ]
    assert offenders == []


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m == "raytrain" or m.startswith("raytrain.")}


def layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


FORBIDDEN = {
    # the recipe is a workload like any user's: the public API and the shared contracts only
    "recipe": ("raytrain.service", "raytrain.launch", "raytrain.ray_internals", "raytrain.slurm_env", "raytrain.cli"),
    # the node side of the batch script knows nothing of drivers or recipes
    "launch": ("raytrain.service", "raytrain.recipe", "raytrain.cli"),
    # the service runs any workload, so it never needs the built-in one
    "service": ("raytrain.recipe", "raytrain.launch", "raytrain.cli"),
    # contracts are leaves
    "contracts": ("raytrain.service", "raytrain.recipe", "raytrain.launch", "raytrain.cli", "raytrain.ray_internals"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layers_import_one_way(package: str) -> None:
    bad = {
        str(path.relative_to(REPO)): sorted(m for m in imports_of(path) if m.startswith(FORBIDDEN[package]))
        for path in (PACKAGE / package).rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_ray_internals_are_touched_in_one_module() -> None:
    private = re.compile(r"\bray\.(_private|_raylet|train\._internal|train\.v2\._internal)|ray\.train\.torch\.config\b")
    users = sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if private.search(p.read_text()))
    assert users == ["raytrain/ray_internals.py"]


def test_metric_keys_the_service_reads_are_keys_of_the_recipe_reports() -> None:
    reported = EpochMetrics.__annotations__
    assert {metrics.EPOCH, metrics.EPOCHS, metrics.STARTUP, metrics.RESUMED} <= set(reported)


def test_result_schema_round_trips() -> None:
    result = RunResult(name="r", kind="fit", status="completed", world_size=2, backend="gloo")
    assert RunResult.from_json(result.to_json()) == result


def test_the_public_api_resolves_from_its_one_list_and_the_version_from_metadata() -> None:
    """``import raytrain`` exports exactly what ``__init__.pyi`` (the list type checkers read) names, each
    from the module the stub says; the version comes from the package's metadata (``pyproject.toml``)."""
    import importlib
    from importlib.metadata import version

    import raytrain

    stub = ast.parse((PACKAGE / "__init__.pyi").read_text())
    listed = {a.name: f"raytrain.{n.module}" for n in stub.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert sorted(listed) == raytrain.__all__ == sorted(dir(raytrain)) and len(listed) >= 17
    for name, module in listed.items():
        assert getattr(raytrain, name) is getattr(importlib.import_module(module), name), name
    assert raytrain.__version__ == version("raytrain")
    assert "__version__ =" not in (PACKAGE / "__init__.py").read_text()
    with pytest.raises(AttributeError):
        raytrain.no_such_name  # noqa: B018


def test_the_public_api_imports_whole_with_lazy_loaders_eager_switch() -> None:
    """``EAGER_IMPORT`` (lazy_loader's switch, passed on to jobs by sbatch) imports every module while the
    package is being made; those import ``raytrain.__version__`` and submodules from it meanwhile."""
    code = "import raytrain; print(raytrain.__version__, raytrain.train.__module__)"
    eager = {**os.environ, "EAGER_IMPORT": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=eager, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[1] == "raytrain.service.trainer", out.stderr[-2000:]


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports when it runs, at load or inside a function (the imports under
    ``if TYPE_CHECKING:`` never run)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from pkg.mod import thing` imports pkg.mod
                name = name.rpartition(".")[0]
            if name and name != "raytrain":  # the package itself loads its names lazily
                found.add(name)
    return found - {_module(path)}


def test_no_module_of_the_package_imports_itself_back() -> None:
    """No import cycle inside the package, function-local imports included (a local import that hides a
    cycle still runs)."""
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _runtime_imports(p, set(paths)) for m, p in paths.items()}

    def back_to(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            here, trail = stack.pop()
            for nxt in sorted(graph[here]):
                if nxt == start:
                    return [*trail, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
        return None

    cycles = [cycle for m in sorted(graph) if (cycle := back_to(m))]
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_the_events_are_a_leaf_without_ray() -> None:
    """Both sides import the event types: they load without Ray and import nothing of the service."""
    path = PACKAGE / "service" / "events.py"
    top = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]
    loaded = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    loaded |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in loaded if m == "ray" or m.startswith(("ray.", "raytrain.service"))}


def test_every_slurm_command_and_variable_is_in_the_slurm_adapter() -> None:
    """One module runs Slurm's commands (bounded, parsed once) and reads its variables."""
    command = re.compile(r"""["'](squeue|scontrol|scancel|sbatch|sinfo|srun|sacct|sstat)["']""")
    variable = re.compile(r"""["']SLURMD?_[A-Z_]+["']""")
    offenders = sorted(
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        if path.name != "slurm_env.py" and (command.search(path.read_text()) or variable.search(path.read_text()))
    )
    assert offenders == []


def test_a_scripts_ray_job_hands_its_actors_what_raytrains_callback_needs() -> None:
    """A stock Tune script's trials start trainers in actors, whose environment is their raylet's: the
    driver's job config carries the callback and the job's directory to them, keeping the user's own."""
    theirs = {"runtime_env": {"env_vars": {env.JOB_DIR.name: "/theirs", "MINE": "1"}, "pip": ["x"]}}
    environ = {
        env.TRAIN_CALLBACKS.name: env.SERVICE_CALLBACK,
        env.JOB_DIR.name: "/state/42",
        env.JOB_CONFIG.name: json.dumps(theirs),
    }
    env.pass_to_actors(environ)
    runtime_env = json.loads(environ[env.JOB_CONFIG.name])["runtime_env"]
    assert runtime_env["env_vars"] == {
        env.JOB_DIR.name: "/theirs",
        "MINE": "1",
        env.TRAIN_CALLBACKS.name: env.SERVICE_CALLBACK,
    }
    assert runtime_env["pip"] == ["x"]
    # A job config that names a callback list of the user's gets raytrain's added; a null runtime_env is none.
    named = {env.JOB_CONFIG.name: json.dumps({"runtime_env": {"env_vars": {env.TRAIN_CALLBACKS.name: "my.Cb"}}})}
    env.pass_to_actors(named)
    callbacks = json.loads(named[env.JOB_CONFIG.name])["runtime_env"]["env_vars"][env.TRAIN_CALLBACKS.name]
    assert callbacks == f"my.Cb,{env.SERVICE_CALLBACK}"
    null = {env.JOB_CONFIG.name: json.dumps({"runtime_env": None}), env.JOB_DIR.name: "/state/42"}
    env.pass_to_actors(null)
    assert json.loads(null[env.JOB_CONFIG.name])["runtime_env"]["env_vars"][env.JOB_DIR.name] == "/state/42"


def test_only_the_batch_drivers_cancel_is_noted_and_only_its_status_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch script ends the job with a driver's 143 only when the driver said it ended on request: a
    driver killed (137, or 143 from a SIGTERM) still counts as the cluster failing under it."""
    monkeypatch.setenv(env.JOB_DIR.name, str(tmp_path))
    monkeypatch.delenv(env.BATCH_DRIVER.name, raising=False)
    jobdir.note_driver_ended(EXIT_CANCELLED)  # a driver from raytrain submit: the job does not end with it
    assert not jobdir.driver_ended(tmp_path, EXIT_CANCELLED)
    monkeypatch.setenv(env.BATCH_DRIVER.name, "1")
    jobdir.note_driver_ended(EXIT_CANCELLED)
    assert jobdir.driver_ended(tmp_path, EXIT_CANCELLED) and not jobdir.driver_ended(tmp_path, 137)
