"""Read docker-compose.yml the way `docker compose` would, for the parts the netns test runs.

Also the Dockerfile's last stage, for the image's health check.

Only what the test needs: each service's command, environment (with `${VAR}`,
`${VAR:-default}`, `${VAR:?message}` and `$$` interpolated from a given
mapping), replica count, named volumes and start order. Anything the test
would silently get wrong (a string command with shell syntax, an unknown
volume) is refused with the service named.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE_FILE.with_name(".env.example")
DOCKERFILE = COMPOSE_FILE.with_name("Dockerfile")
# The variable that chooses the model the coordinator runs (and so the workers, which take its model).
MODEL_ENV = "RLX_MODEL"

# $$ escapes a dollar; ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?err}, ${NAME?err}; or $NAME.
_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class ComposeError(Exception):
    """A compose file the test cannot run as written."""


def interpolate(text: str, env: Mapping[str, str], where: str) -> str:
    """Substitute variables in `text` as compose does; `where` names the field in errors."""

    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        value, op, arg = env.get(name), match["op"] or "", match["arg"] or ""
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("?") and unset:
            raise ComposeError(f"{where}: ${{{name}}} is required: {arg or 'not set'}")
        if op.endswith("-") and unset:
            return arg
        return value or ""

    return _VAR.sub(one, text)


def variables(text: str) -> set[str]:
    """Name every variable `text` reads (escaped `$$` excluded)."""
    return {m["braced"] or m["bare"] for m in _VAR.finditer(text) if not m["escaped"]}


@dataclass(frozen=True)
class Service:
    """One service: what each of its replicas runs.

    name: the service's name, which the other services resolve.
    command: argv, interpolated.
    environment: variables set for the command, interpolated.
    replicas: how many copies compose starts (deploy.replicas, default 1).
    volumes: mount path in the container -> named volume.
    depends_on: services to start first.
    """

    name: str
    command: list[str]
    environment: dict[str, str]
    replicas: int = 1
    volumes: dict[str, str] = field(default_factory=dict)
    depends_on: tuple[str, ...] = ()

    def replica_names(self) -> list[str]:
        """Name each replica's host: the service's name alone, or numbered (`worker-1`, ...) when several."""
        if self.replicas == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(1, self.replicas + 1)]

    def argv(self, mounts: Mapping[str, Path]) -> list[str]:
        """The command with each volume's mount path replaced by the directory standing in for it."""
        return [self._mounted(arg, mounts) for arg in self.command]

    def option(self, name: str) -> str:
        """The value that follows `name` in the command (`--model` → `smollm2`); a ComposeError without it."""
        if name not in self.command[:-1]:
            raise ComposeError(f"service {self.name}: its command has no {name} VALUE")
        return self.command[self.command.index(name) + 1]

    def env(self, mounts: Mapping[str, Path]) -> dict[str, str]:
        """The environment with volume mount paths replaced like `argv`."""
        return {k: self._mounted(v, mounts) for k, v in self.environment.items()}

    def _mounted(self, text: str, mounts: Mapping[str, Path]) -> str:
        for target, volume in self.volumes.items():
            if text == target or text.startswith(target + "/"):
                return str(mounts[volume]) + text[len(target) :]
        return text


def load(path: Path, env: Mapping[str, str]) -> list[Service]:
    """Read the services of a compose file in start order (dependencies first)."""
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ComposeError(f"{path}: no services mapping")
    named_volumes = set(doc.get("volumes") or {})
    services = [_service(name, spec, env, named_volumes) for name, spec in doc["services"].items()]
    return _start_order(services)


def _service(name: str, spec: dict, env: Mapping[str, str], named_volumes: set[str]) -> Service:
    command = spec.get("command")
    if isinstance(command, str):
        if any(c in command for c in "|&;<>()`"):
            raise ComposeError(f"service {name}: command has shell syntax; write it as a list")
        command = shlex.split(command)
    if not isinstance(command, list) or not command:
        raise ComposeError(f"service {name}: command must be a non-empty list")
    environment = spec.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.partition("=")[::2] for item in environment)
    volumes = {}
    for entry in spec.get("volumes") or []:
        volume, _, target = str(entry).partition(":")
        if volume not in named_volumes:
            raise ComposeError(f"service {name}: volume {volume!r} is not a named volume of the file")
        volumes[target.split(":")[0]] = volume
    where = f"service {name}"
    return Service(
        name=name,
        command=[interpolate(str(arg), env, f"{where} command") for arg in command],
        environment={str(k): interpolate(str(v), env, f"{where} {k}") for k, v in environment.items()},
        replicas=int((spec.get("deploy") or {}).get("replicas", 1)),
        volumes=volumes,
        depends_on=tuple(spec.get("depends_on") or ()),
    )


def _start_order(services: list[Service]) -> list[Service]:
    by_name = {s.name: s for s in services}
    ordered: list[Service] = []

    def visit(service: Service, path: tuple[str, ...]) -> None:
        if service.name in path:
            raise ComposeError(f"services depend on each other in a circle: {' -> '.join(path)}")
        for dep in service.depends_on:
            if dep not in by_name:
                raise ComposeError(f"service {service.name} depends on unknown service {dep!r}")
            visit(by_name[dep], (*path, service.name))
        if service not in ordered:
            ordered.append(service)

    for service in services:
        visit(service, ())
    return ordered


def final_stage(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The instructions of a Dockerfile's last stage, one per line, continuations joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    return lines[last_from:]


def healthcheck(dockerfile: Path = DOCKERFILE) -> list[str]:
    """The argv of the image's HEALTHCHECK (exec form)."""
    checks = [line for line in final_stage(dockerfile) if line.upper().startswith("HEALTHCHECK ")]
    if len(checks) != 1 or " CMD [" not in checks[0]:
        raise ComposeError(
            f"{dockerfile}: expected one HEALTHCHECK ... CMD [...] in the last stage, got {checks}"
        )
    return json.loads(checks[0].split(" CMD ", 1)[1])
