"""The flag table: docs/cli.md made from it is current, the options and the Helm chart agree with it."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from coordinator.options import CoordinatorOptions
from minedraft.flag_spec import FLAG_KEY, WORKERS
from minedraft.rpc.options import WorkerOptions
from minedraft_app import flags
from minedraft_app.cli import build_parser, coordinator_options, worker_options
from minedraft_app.flags import COMMANDS, FLAGS, HELM_COMPONENTS, STACK_SERVICES, STACKS, flags_of, option_flags

REPO_ROOT = Path(__file__).resolve().parents[1]
GENERATOR = REPO_ROOT / "scripts" / "generate_cli_docs.py"
CHART = REPO_ROOT / "helm" / "minedraft"
TEMPLATE_COMPONENTS = {"model-services.yaml": ("target", "draft"), "coordinator.yaml": ("coordinator",)}
PAIR_TEMPLATE = "pair.yaml"  # the pair layout's pod runs `minedraft serve`
# Fields cli.worker_options derives from a flag of another name
WORKER_FIELDS_FROM_SWITCHES = {"cuda_graphs": "--eager", "prefix_caching": "--enable-prefix-caching"}
OPTIONS = (WorkerOptions, CoordinatorOptions)
# Where a serve stack gives a service other than that service's own default: the target's dir (the coordinator's
# tokenizer, the draft's --target-model-for-draft, whose own default falls back to its --model)
STACK_DEFAULTS_OF_THEIR_OWN = {("--target", "coordinator"), ("--target", "draft")}


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_cli_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_current() -> None:
    committed = (REPO_ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == load_generator().reference(), (
        "docs/cli.md differs from the flag table in minedraft_app/flags.py (and the options' fields it takes flags "
        "from); run `python scripts/generate_cli_docs.py`"
    )


def test_a_flag_is_declared_once_per_command_and_only_in_the_table() -> None:
    for command in COMMANDS:
        names = [flag.name for flag in flags_of(command)]
        assert len(names) == len(set(names)), command
    for path in (REPO_ROOT / "minedraft_app").glob("*.py"):
        if path.name == "flags.py":
            continue
        calls = [
            node.lineno
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Attribute) and node.attr == "add_argument"
        ]
        assert not calls, f"{path.name} declares flags (lines {calls}): declare them in minedraft_app/flags.py"


def test_what_a_stack_passes_on_reaches_a_flag_of_that_service() -> None:
    passed = [flag for flag in FLAGS if flag.passes_to]
    for flag in passed:
        assert set(flag.commands) & set(STACKS), f"{flag.name}: only serve and bench start services"
        for service, name in flag.passed_on.items():
            assert service in STACK_SERVICES, (flag.name, service)
            assert name in [f.name for f in flags_of(service)], f"{flag.name}: {service} has no {name}"
    destinations = [flag.dest for flag in passed]
    assert len(destinations) == len(set(destinations)), "a stack reads each value it passes on from one attribute"


@pytest.mark.parametrize(
    ("options", "commands", "from_switches"),
    [
        (WorkerOptions, ("target", "draft"), WORKER_FIELDS_FROM_SWITCHES),
        (CoordinatorOptions, ("coordinator",), {}),
    ],
)
def test_every_option_is_set_by_a_flag(options: type, commands: tuple[str, ...], from_switches: dict[str, str]) -> None:
    """`cli.worker_options` and `cli.coordinator_options` take each field from the flag of that name: a field that
    no flag names would keep its default, whatever the command line says."""
    destinations = {flag.dest for command in commands for flag in flags_of(command)}
    for field in dataclasses.fields(options):
        name = field.metadata[FLAG_KEY].dest if FLAG_KEY in field.metadata else field.name  # (--compile's field)
        assert name in destinations or field.name in from_switches, f"no flag sets {options.__name__}.{field.name}"
    for name in from_switches.values():
        assert all(name in [f.name for f in flags_of(command)] for command in commands), name


def test_each_options_flag_is_in_the_table_once() -> None:
    for options in OPTIONS:
        for name, flag in option_flags(options).items():
            assert sum(entry == flag for entry in FLAGS) == 1, f"{options.__name__}.{name}: place {flag.name} in FLAGS"


@pytest.mark.parametrize("options", OPTIONS)
def test_each_options_field_has_the_default_of_its_flag(options: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a command's parser gives a field's flag when not given is the field's default, except where the flag
    names a command's own default (--http-port: 8000 on the command line, 0 in code)."""
    for flag in FLAGS:
        monkeypatch.delenv(flag.env, raising=False)
    required = {"coordinator": ["--target", "t"]}
    parsed = {command: build_parser().parse_args([command, *required.get(command, [])]) for command in STACK_SERVICES}
    parsed |= {command: build_parser().parse_args([command]) for command in STACKS}
    checked = 0
    for field in dataclasses.fields(options):
        if FLAG_KEY not in field.metadata:
            continue
        flag = field.metadata[FLAG_KEY]
        for command in set(flag.commands) - set(flag.defaults):
            if field.default is not dataclasses.MISSING:
                assert getattr(parsed[command], flag.dest) == field.default, (options.__name__, field.name, command)
                checked += 1
    assert checked > 20
    # Options from bare commands are the options' defaults, those derived from a flag of another kind included
    for worker in WORKERS:
        assert worker_options(parsed[worker]) == WorkerOptions(parsed[worker].model)
    assert coordinator_options(parsed["coordinator"]) == CoordinatorOptions(target="t", draft=None, http_port=8000)


def test_a_flag_takes_its_default_and_type_from_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change an options field's default, and its flag's default changes with it: in the parser and in the docs."""
    original = {field.name: field for field in dataclasses.fields(CoordinatorOptions)}["num_speculative_tokens"]

    @dataclasses.dataclass
    class Changed(CoordinatorOptions):
        num_speculative_tokens: int = dataclasses.field(default=7, metadata=original.metadata)

    flag = option_flags(Changed)["num_speculative_tokens"]
    assert (flag.default, flag.type, flag.switch) == (7, int, False)
    assert option_flags(WorkerOptions)["compile_layers"].switch  # a bool field's flag is a switch
    monkeypatch.setattr(flags, "FLAGS", tuple(flag if f.dest == flag.dest else f for f in FLAGS))
    monkeypatch.delenv(flag.env, raising=False)
    assert build_parser().parse_args(["serve"]).num_speculative_tokens == 7
    assert "| `--num-speculative-tokens` | integer | `7` |" in load_generator().command_reference("coordinator")


def test_serve_gives_each_service_its_own_default() -> None:
    """A value that serve passes on is by default the one the service would take by itself."""
    for flag in flags_of("serve"):
        for service, name in flag.passed_on.items():
            if (flag.name, service) in STACK_DEFAULTS_OF_THEIR_OWN:
                continue
            own = next(f for f in flags_of(service) if f.name == name)
            assert flag.default_in("serve") == own.default_in(service), (flag.name, service)


def chart_env() -> dict[str, list[tuple[str, str]]]:
    """Component -> (MINEDRAFT_ variable, the template's value expression) for each variable its pod gets."""
    found: dict[str, list[tuple[str, str]]] = {component: [] for component in HELM_COMPONENTS}
    for template, components in TEMPLATE_COMPONENTS.items():
        text = (CHART / "templates" / template).read_text(encoding="utf-8")
        for name, expression in re.findall(r'"(MINEDRAFT_[A-Z0-9_]+)"\s+(.*)', text):
            for component in components:
                found[component].append((name, expression))
    return found


def test_the_chart_sets_the_variables_of_the_flags_it_names() -> None:
    yaml = pytest.importorskip("yaml")
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    for component, env in chart_env().items():
        flags = {flag.env: flag for flag in flags_of(component) if flag.reads_env(component)}
        for name, expression in env:
            assert name in flags, f"the chart sets {name} in the {component} pod: no {component} flag reads it"
            keys = re.findall(r"\$(?:svc|c)\.(\w+)", expression)  # the values it reads under the component
            if keys:
                flag = flags[name]
                assert component in flag.helm and keys == [flag.helm_key], f"{component}: {name} from {keys}"
        for flag in flags.values():
            if component in flag.helm:
                assert flag.helm_key in values[component], f"values.yaml has no {component}.{flag.helm_key}"
                assert flag.env in dict(env), f"the chart does not set {flag.env} in the {component} pod"


def test_the_pair_pod_sets_only_variables_that_serve_reads() -> None:
    """The pair layout's `minedraft serve` container: each MINEDRAFT_ variable it gets is one a serve flag reads (a
    misspelt one would be ignored), and a worker setting comes from the target's value of that flag."""
    text = (CHART / "templates" / PAIR_TEMPLATE).read_text(encoding="utf-8")
    serve = {flag.env: flag for flag in flags_of("serve") if flag.reads_env("serve")}
    found = re.findall(r'"(MINEDRAFT_[A-Z0-9_]+)"\s+(.*)', text)
    assert len(found) > 20, "no variables found in the pair template"
    for name, expression in found:
        assert name in serve, f"the pair pod sets {name}: no serve flag reads it"
        for component, key in re.findall(r"\$(t|d|c)\.(\w+)", expression):
            owner = {"t": "target", "d": "draft", "c": "coordinator"}[component]
            flag = serve[name]
            if key != "model":  # serve's --target and --draft take the workers' model directories
                assert key == flag.helm_key and owner in flag.helm, (name, key)
