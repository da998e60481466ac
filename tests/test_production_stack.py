"""The production stack cannot rot unseen: compose.yaml is valid by the compose
specification's JSON schema, every image it builds has a Dockerfile whose COPY sources
exist, it runs every component `liverl up` runs, and it holds no secret."""

import importlib.util
import json
import re
from pathlib import Path

import dockerfile
import jsonschema
import pytest
import yaml

from app.stack import COMPONENTS
from liverl.settings import SECRET_FIELDS, PortsConfig

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
LIVERL_SERVICES = {name: s for name, s in COMPOSE["services"].items() if s.get("image") == "liverl:latest"}


def compose_schema() -> dict:
    # check-jsonschema vendors the compose-spec schema; read the file without importing
    # its CLI.
    location = importlib.util.find_spec("check_jsonschema").submodule_search_locations[0]
    return json.loads((Path(location) / "builtin_schemas" / "vendor" / "compose-spec.json").read_text())


def test_compose_file_matches_the_compose_specification():
    validator = jsonschema.Draft7Validator(compose_schema())  # the draft the schema is written in
    validator.validate(COMPOSE)
    misspelt = dict(COMPOSE, services={"api": dict(COMPOSE["services"]["api"], prots=["1:1"])})
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        validator.validate(misspelt)


def builds() -> list[tuple[str, Path, Path]]:
    found = []
    for name, service in COMPOSE["services"].items():
        build = service.get("build")
        if build is None:
            continue
        context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
        found.append((name, context, context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict)
                                                else "Dockerfile")))
    return found


@pytest.mark.parametrize("service,context,path", builds(), ids=[b[0] for b in builds()])
def test_every_built_image_has_a_dockerfile_whose_copy_sources_exist(service, context, path):
    assert path.exists(), f"{service}: {path.relative_to(ROOT)} is missing"
    commands = dockerfile.parse_file(str(path))
    assert commands[0].cmd == "FROM"
    copies = [c for c in commands if c.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in c.flags)]
    assert copies, f"{path.name} copies nothing of liverl"
    for command in copies:
        for source in command.value[:-1]:
            assert (context / source).exists(), f"{path.name}:{command.start_line}: COPY source {source} is missing"


def test_compose_runs_every_component_that_liverl_up_runs():
    modules = {re.search(r"python -m ([\w.]+)", s["command"]).group(1) for s in LIVERL_SERVICES.values()}
    # The supervisor is `liverl up`'s own restarter; compose restarts by its restart policy.
    assert modules == set(COMPONENTS.values()) - {COMPONENTS["supervisor"]}
    assert all(s.get("restart") for s in LIVERL_SERVICES.values()), "a service compose would not restart"
    for name, module in COMPONENTS.items():
        assert importlib.util.find_spec(module), f"{name}: no module {module}"
    published = {int(p.split(":")[-1]) for s in LIVERL_SERVICES.values() for p in s.get("ports", [])}
    assert published <= set(PortsConfig().model_dump().values()), "a published port no component listens on"


def test_no_secret_is_written_in_the_compose_file():
    secret_name = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY", re.I)
    for name, service in COMPOSE["services"].items():
        for key, value in (service.get("environment") or {}).items():
            assert not secret_name.search(key), f"{name}: {key} belongs in liverl.env"
            if key.startswith("LIVERL_") and str(value).startswith("{"):
                for fields in SECRET_FIELDS.values():
                    assert not fields & set(json.loads(value)), f"{name}: {key} holds a secret"
    # What the services read instead: liverl.env, described by its example.
    example = (ROOT / "liverl.env.example").read_text()
    for section, fields in SECRET_FIELDS.items():
        for field in fields:
            assert f"LIVERL_{section.upper()}__{field.upper()}=" in example
    assert "liverl.env" in (ROOT / ".gitignore").read_text()


def test_every_file_a_service_mounts_from_the_repository_exists():
    mounts = [(name, volume.split(":")[0]) for name, service in COMPOSE["services"].items()
              for volume in service.get("volumes", []) if volume.startswith("./")]
    assert ("api", "./liverl.toml") in mounts  # the deployment's analysis reaches every liverl service
    for name, source in mounts:
        assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
