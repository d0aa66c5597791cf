"""What a `minedraft` flag is, and `flag`, which declares one on an options field beside its only default."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
ENV_PREFIX = "MINEDRAFT_"
FLAG_KEY = "minedraft.flag"  # where a field's metadata holds its Flag

# The commands that share flags; COMMANDS in minedraft_app/flags.py says what each does.
SERVICE_COMMANDS = ("serve", "target", "draft", "coordinator")  # MINEDRAFT_<FLAG> sets their flags
STACK_SERVICES = ("target", "draft", "coordinator")  # what `serve` and `bench --modes` start
WORKERS = ("target", "draft")
STACKS = ("serve", "bench")
MODEL_COMMANDS = ("serve", "target", "draft", "bench")  # those that load models, or start services that do
POLICY_COMMANDS = ("serve", "coordinator", "bench")  # the coordinator's step policy, also set by a bench stack
COORDINATOR_COMMANDS = ("serve", "coordinator")

# The sections of a command's --help, in this order.
MEASUREMENT = "measurement"
REQUEST = "request"
MODELS = "models"
BATCHES = "batches"
SPECULATION = "speculation"
SERVICE = "service"
SECTIONS = (MEASUREMENT, REQUEST, MODELS, BATCHES, SPECULATION, SERVICE)


@dataclass(frozen=True)
class PassTo:
    """A service that a serve/bench stack gives a flag's value, by that service's flag (None: of the same name)."""

    service: str
    flag: str | None = None


# The help of --lease-secret, a flag of the coordinator's and of the workers' options alike
LEASE_SECRET_HELP = (
    "secret the coordinator presents with its lease on each worker; a worker started with one leases to no "
    "coordinator without it (give the same to both; prefer MINEDRAFT_LEASE_SECRET, out of the process list). "
    "Without it a coordinator makes a random one, which keeps a process that reads its errors from taking its "
    "lease but not from taking a free worker: split deployments set one, or mTLS"
)
TO_WORKERS = (PassTo("target"), PassTo("draft"))
TO_COORDINATOR = (PassTo("coordinator"),)
TO_SERVICES = (*TO_WORKERS, *TO_COORDINATOR)


def dest(name: str) -> str:
    """The attribute a flag's value lands in: --max-batch-size -> max_batch_size."""
    return name.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Flag:
    """One flag of one or more commands; a name means one thing in the commands that share an entry."""

    name: str
    help: str
    commands: tuple[str, ...]
    section: str
    default: object = None
    defaults: Mapping[str, object] = field(default_factory=dict)  # a command's own default, where it differs
    helps: Mapping[str, str] = field(default_factory=dict)  # a command's own help, where it differs
    type: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # given bare, it sets True
    const: str | None = None  # the value when given bare (its value is optional)
    repeat: bool = False  # each use adds a value to a list, empty by default
    nargs: str | None = None  # "+": one or more values after the flag, a list (MINEDRAFT_<FLAG>: space-separated)
    required: bool = False  # unless its environment variable is set
    one_of: str | None = None  # exactly one flag of each one_of group must be given
    environment: tuple[str, ...] | None = None  # commands where MINEDRAFT_<FLAG> sets it; None: the services'
    passes_to: tuple[PassTo, ...] = ()  # the services a serve/bench stack gives its value
    helm: tuple[str, ...] = ()  # chart components whose value <component>.<helm_key> sets MINEDRAFT_<FLAG>

    @property
    def dest(self) -> str:
        return dest(self.name)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def helm_key(self) -> str:
        first, *rest = self.dest.split("_")
        return first + "".join(word.capitalize() for word in rest)

    @property
    def passed_on(self) -> dict[str, str]:
        """Service -> the flag of that service which a serve/bench stack gives this flag's value."""
        return {to.service: to.flag or self.name for to in self.passes_to}

    def default_in(self, command: str) -> object:
        return self.defaults.get(command, self.default)

    def help_in(self, command: str) -> str:
        return self.helps.get(command, self.help)

    def reads_env(self, command: str) -> bool:
        commands = self.environment if self.environment is not None else SERVICE_COMMANDS
        return command in commands


def flag(default: T, name: str, help: str, commands: tuple[str, ...], section: str, **spec: object) -> T:
    """An options field whose `default` is also the flag's (`minedraft_app.flags.option_flags` reads it there, and
    the flag's type from the field's); `spec` holds Flag's other fields. A field without a default declares
    `field(metadata={FLAG_KEY: Flag(...)})` itself."""
    return field(default=default, metadata={FLAG_KEY: Flag(name, help, commands, section, **spec)})  # type: ignore[arg-type]
