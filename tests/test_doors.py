"""One door per optional concept: delete a concept's files from a copy of the trainer and the
rest still imports, parses its flags and (with everything optional gone) trains a plain run.
Each concept's docstring lists its doors; this is the test that they are the only ones, all in
root files: infra/ (what a run stands on) imports nothing outside itself and opens no door."""

import ast
import glob
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ENV, ROOT, flags

# A concept and the files that are it. Core files name it only at their doors, lazily.
CONCEPTS = {
    "lora": ["lora"],
    "sequence_parallel": ["sequence_parallel.py"],
    "environments": ["envs"],
    "sandbox": ["envs/sandbox.py", "envs/sandbox_process.py", "envs/python_tool.py"],
    "openenv": ["envs/openenv_adapter.py"],
    "agents": ["agent_programs", "examples"],
    "distill": ["distill"],
    "nccl": ["nccl_sync.py"],
}
# Where the core imports each concept: file and function, each a lazy import under the concept's flag.
DOORS = {
    "lora": {"train.py:model_doors", "reference.py:make_reference", "train.py:check_model", "train.py:announce",
             "train.py:export_transform", "train.py:make_sync"},
    "sequence_parallel": {"train.py:model_doors", "train.py:check_model", "update.py:train_on_batch"},
    "environments": {"train.py:choose_player"},
    "agents": {"train.py:choose_player"},
    "distill": {"reference.py:make_reference", "train.py:check_model", "train.py:server_plan"},
    "nccl": {"train.py:make_sync"},
}
DOCSTRINGS = {"lora": "lora/__init__.py", "sequence_parallel": "sequence_parallel.py",
              "environments": "envs/__init__.py", "agents": "agent_programs/__init__.py",
              "distill": "distill/__init__.py", "nccl": "nccl_sync.py"}
INFRA = "infra"  # the folder of what a run stands on: core, not optional
OPTIONAL = [m for files in CONCEPTS.values() for f in files for m in [f[:-3].replace("/", ".") if f.endswith(".py") else f]]


def test_every_folder_of_code_at_the_root_is_an_optional_concept():
    """The root is the core: a folder of Python there is an optional concept, listed above and so
    deleted by the tests below (scripts, benchmarks and the like are tools, not the trainer)."""
    tools = {"scripts", "benchmarks", "experiments", "tests", "docs", "models", "output", INFRA}
    folders = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and not d.startswith((".", "_"))
               and glob.glob(os.path.join(ROOT, d, "*.py")) and d not in tools}
    assert folders == {f for files in CONCEPTS.values() for f in files if "/" not in f and not f.endswith(".py")}


def modules_imported(node):
    """The modules an import statement names: `from infra import memory` names infra.memory."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return [f"{node.module}.{a.name}" for a in node.names] if node.module == INFRA else [node.module]
    return []


def imports_of(concept):
    """file:function (or file:top) of every import of the concept's modules in the other root files
    and in infra/'s (where there must be none)."""
    own = {os.path.basename(f)[:-3] for f in CONCEPTS[concept] if f.endswith(".py")} | {f for f in CONCEPTS[concept]
                                                                                      if not f.endswith(".py")}
    found = set()
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, INFRA, "*.py")):
        name = os.path.relpath(path, ROOT)
        if name[:-3] in own:
            continue
        tree = ast.parse(open(path).read())
        where = {id(n): fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for n in ast.walk(fn)}
        for n in ast.walk(tree):
            if any(m.split(".")[0] in own for m in modules_imported(n)):
                found.add(f"{name}:{where.get(id(n), 'top')}")
    return found


@pytest.mark.parametrize("concept", sorted(DOORS))
def test_the_core_imports_a_concept_only_at_its_doors(concept):
    """Read from the code: the core files import the concept in the functions listed (never at the
    top of a file), and the concept's docstring names each of them."""
    assert imports_of(concept) == DOORS[concept]
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, DOCSTRINGS[concept])).read()))
    assert all(door.split(":")[1] in doc for door in DOORS[concept]), doc


def unit_of(module, units):
    """The unit a module belongs to: infra.X is a unit of its own, an optional folder's modules are the folder."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == INFRA else parts[0] if parts[0] in units else None


def import_graph():
    """{unit: the units it imports}, read from the code (lazy imports too): a unit is a root .py file,
    a file of infra/ (infra.memory) or a folder of the trainer (an optional concept)."""
    units = {os.path.basename(p)[:-3]: [p] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    units |= {f"{INFRA}.{os.path.basename(p)[:-3]}": [p] for p in glob.glob(os.path.join(ROOT, INFRA, "*.py"))
              if not p.endswith("__init__.py")}
    units |= {f: glob.glob(os.path.join(ROOT, f, "*.py")) for files in CONCEPTS.values() for f in files
              if "/" not in f and not f.endswith(".py")}
    graph = {u: set() for u in units}
    for unit, paths in units.items():
        for n in (n for p in paths for n in ast.walk(ast.parse(open(p).read()))):
            graph[unit] |= {unit_of(m, units) for m in modules_imported(n)} - {unit, None}
    return graph


def test_infra_imports_only_infra():
    """What a run stands on is plumbing: infra/'s files import nothing of ours outside infra/ (no research
    file, no optional concept); the root hands infra what it needs (a batch maker, a sync, a converter)."""
    graph = import_graph()
    outside = {u: sorted(v for v in vs if not v.startswith(INFRA + ".")) for u, vs in graph.items() if u.startswith(INFRA)}
    assert {u: vs for u, vs in outside.items() if vs} == {}
    assert len(outside) >= 15, sorted(outside)  # read from every file of infra/


def test_imports_point_one_way_in_at_most_seven_floors():
    """No circle among the trainer's files and folders, and at most seven floors: a file stands one floor
    above the highest it imports (those that import nothing of ours are floor 1; train.py is the top). The
    seventh came with the memory plan asking its owners for their facts (the sync's part, the logprob
    chunk) instead of holding copies: train > reference > distill > vllm_server > memory > policy > attention.
    Read from import statements: a folder is one unit (its files' imports among themselves not seen),
    and a module named in a string (worker_pool's forkserver preloads envs.calls) draws no arrow."""
    graph, floor = import_graph(), {}

    def floor_of(unit, path=()):
        assert unit not in path, f"a circle of imports: {' -> '.join(path[path.index(unit):] + (unit,))}"
        if unit not in floor:
            floor[unit] = 1 + max((floor_of(v, path + (unit,)) for v in graph[unit]), default=0)
        return floor[unit]
    assert max(floor_of(u) for u in graph) == floor_of("train") <= 7, floor


def copy_without(tmp_path, deleted):
    """The trainer's files (no tests) in tmp_path, less `deleted`."""
    out = tmp_path / "repo"
    shutil.copytree(ROOT, out, ignore=shutil.ignore_patterns("tests", ".*", "__pycache__", "models", "output",
                                                             "*.egg-info", "benchmarks", "experiments", "docs"))
    for path in deleted:
        target = out / path
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    return out


def python(repo, *args, timeout=600):
    env = dict(ENV, PYTHONPATH=str(repo))
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.subprocess
@pytest.mark.parametrize("concept", sorted(CONCEPTS))
def test_a_concept_deleted_leaves_the_trainer_working(concept, tmp_path):
    repo = copy_without(tmp_path, CONCEPTS[concept])
    # `import train`, then train.py --help as its command line runs it, in one process (one import of torch)
    out = python(repo, "-c", "import runpy, sys, train; sys.argv = ['train.py', '--help']; "
                             "runpy.run_path('train.py', run_name='__main__')")
    assert out.returncode == 0 and "--model_name_or_path" in out.stdout, out.stderr[-2000:]


# What a plain run imports of ours: the research files at the root and the machinery in infra/, nothing else
PLAIN_RUN = ["config", "data", "episodes", "infra", "infra.attention", "infra.checkpoint", "infra.cli", "infra.colocation",
             "infra.faults",
             "infra.generator", "infra.memory", "infra.model_files", "infra.options", "infra.parallel", "infra.policy",
             "infra.ranks", "infra.tracking", "infra.user_code", "infra.vllm_client", "infra.vllm_server", "infra.weight_sync",
             "infra.worker_pool", "loss", "packing", "reference", "rewards", "rollout", "train", "update"]


@pytest.mark.subprocess
def test_a_plain_run_imports_no_optional_concept():
    """Importing the trainer and reading a plain run's config loads none of the optional modules (nor the NCCL
    transport, nor test-only code): exactly PLAIN_RUN of ours."""
    ours = sorted({os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))} | set(OPTIONAL)
                  | {INFRA} | {f"{INFRA}.{os.path.basename(p)[:-3]}" for p in glob.glob(os.path.join(ROOT, INFRA, "*.py"))}
                  | {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "tests", "*.py"))})
    code = ("import sys, train; from infra.cli import parse_args_or_exit; "
            "parse_args_or_exit(train.Config, ['--beta', '0.1']); "
            f"print(sorted(m for m in {ours!r} if m in sys.modules))")
    out = python(ROOT, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == repr(PLAIN_RUN), out.stdout + out.stderr[-2000:]


@pytest.mark.slow
def test_the_plain_trainer_trains_with_every_optional_concept_deleted(tiny_model_dir, tmp_path):
    """2 steps on 2 ranks with an EMA reference, a checkpoint and an export, in a copy that has no
    LoRA, no sequence parallelism, no environments and no agents: the core is whole without them."""
    repo = copy_without(tmp_path, [f for files in CONCEPTS.values() for f in files])
    run_dir = tmp_path / "run"
    args = flags(tiny_model_dir, run_dir, 2, "--checkpoint_state_freq", "2", "--num_unique_prompts_rollout", "2",
                 "--num_samples_per_prompt_rollout", "4", "--response_length", "8")
    out = python(repo, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29657", "train.py",
                 *args, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert os.path.isdir(run_dir / "ckpt" / "step_00000002") and os.path.isdir(run_dir / "out" / "final")
