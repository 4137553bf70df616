"""deploy/: the compose file against the official Compose schema, its commands and the
Kubernetes manifests against apex's own CLI, and the Dockerfile's promises."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from apex import config
from apex.cli import ENV, build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SHARED_SCHEMA = ROOT.parent / "shared" / "schemas" / "compose-spec.json"
VENDORED_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def interpolate(node, env: dict[str, str]):
    """Compose's ${VAR} / ${VAR:-default} substitution, as `docker compose config` does."""
    if isinstance(node, str):
        return VARIABLE.sub(lambda m: env.get(m.group(1), m.group(2) or ""), node)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def compose(name: str = "docker-compose.yml", env: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load((DEPLOY / name).read_text()), env or {})


@pytest.fixture(scope="module")
def schema():
    """The official Compose schema: the shared copy where present, else the vendored one."""
    if SHARED_SCHEMA.exists():
        assert SHARED_SCHEMA.read_bytes() == VENDORED_SCHEMA.read_bytes(), "tests/data copy is out of date"
        return json.loads(SHARED_SCHEMA.read_text())
    return json.loads(VENDORED_SCHEMA.read_text())


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.gpu.yml"])
def test_compose_files_validate_against_the_compose_spec(schema, name):
    jsonschema.Draft7Validator(schema).validate(compose(name))


def test_compose_settings_come_from_the_environment_with_defaults(schema):
    example = dict(
        line.split("=", 1) for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    used = set(VARIABLE.findall((DEPLOY / "docker-compose.yml").read_text()))
    assert {name for name, _ in used} == set(example), "every setting is in .env.example, and only those"
    assert all(default is not None for _, default in used)
    custom = compose(env={**example, "APEX_ACTORS": "8", "APEX_HOST_PORTS": "7000-7002"})
    jsonschema.Draft7Validator(schema).validate(custom)
    assert custom["services"]["actor"]["deploy"]["replicas"] == "8"
    assert custom["services"]["learner"]["ports"] == ["7000-7002:5550-5552"]


def test_compose_services_run_apex_commands_that_parse():
    services = compose()["services"]
    parser = build_parser()
    learner = parser.parse_args(services["learner"]["command"])
    assert learner.command == "learner" and learner.port == 5550 and learner.bind_host == "0.0.0.0"
    assert learner.logdir.startswith("/runs/")
    actor = parser.parse_args(services["actor"]["command"])
    assert actor.command == "actor" and actor.learner == "learner:5550"  # the learner's service name
    # The learner's config path exists in the image: configs/ is copied to /opt/apex-configs.
    assert learner.config.startswith("/opt/apex-configs/")
    assert (ROOT / "configs" / Path(learner.config).name).exists()
    for service in services.values():
        assert set(service.get("environment", {})) <= set(ENV.values())
    assert "ports" not in services["actor"] and "container_name" not in services["actor"]  # it scales
    assert services["tensorboard"]["profiles"] == ["tensorboard"]
    assert "5550-5552" in services["learner"]["ports"][0] and services["learner"]["healthcheck"]["test"]


def k8s_documents() -> dict[str, dict]:
    docs = {}
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if "kind" not in doc:
                continue  # apex-config.yaml: apex's own config, checked below
            docs[f"{doc['kind']}/{doc.get('metadata', {}).get('name', path.stem)}"] = doc
    return docs


def test_kubernetes_manifests_agree_with_each_other_and_the_cli():
    docs = k8s_documents()
    kustomization = docs["Kustomization/kustomization"]
    for resource in kustomization["resources"]:
        assert (DEPLOY / "k8s" / resource).exists()
    (config_file,) = kustomization["configMapGenerator"][0]["files"]
    mounted_name, source = config_file.split("=")
    config.load(DEPLOY / "k8s" / source)  # a valid apex config
    image = kustomization["images"][0]["name"]
    parser = build_parser()
    learner = docs["Deployment/apex-learner"]["spec"]["template"]["spec"]["containers"][0]
    actor = docs["Deployment/apex-actor"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["image"] == actor["image"] == image
    args = parser.parse_args(learner["args"])
    assert args.config == f"/etc/apex/{mounted_name}"
    ports = {p["name"]: p["containerPort"] for p in learner["ports"]}
    assert ports == {"control": args.port, "trajectories": args.port + 1, "weights": args.port + 2}
    service = docs["Service/apex-learner"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert service["spec"]["selector"] == docs["Deployment/apex-learner"]["spec"]["template"]["metadata"]["labels"]
    actor_env = {e["name"]: e["value"] for e in actor["env"]}
    assert set(actor_env) | {e["name"] for e in learner["env"]} <= set(ENV.values())
    assert actor_env["APEX_LEARNER"] == f"{service['metadata']['name']}:{args.port}"
    assert parser.parse_args(actor["args"]).command == "actor"
    assert kustomization["replicas"][0]["name"] == "apex-actor"


def test_kubernetes_curve_overlay_uses_the_files_keygen_writes(tmp_path):
    from apex.transport import generate_keys

    overlay = yaml.safe_load((DEPLOY / "k8s" / "curve" / "kustomization.yaml").read_text())
    written = generate_keys(tmp_path / "keys")
    names = {Path(f).name for f in overlay["secretGenerator"][0]["files"]}
    assert names == {written[k].name for k in ("learner_public", "learner_secret", "actor_public", "actor_secret")}
    learner = yaml.safe_load((DEPLOY / "k8s" / "curve" / "learner-curve.yaml").read_text())
    items = learner["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"]
    assert {"key": "actor.key", "path": "authorized/actor.key"} in items  # the learner's allow-list


def test_dockerfile_is_multi_stage_non_root_with_apex_as_entrypoint():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2, "a build stage and a final stage"
    final = stages[-1]
    assert "g++" not in final and "apt-get" not in final, "no compiler in the final stage"
    user = re.search(r"^USER (\S+)", final, flags=re.M)
    assert user and user.group(1) not in ("root", "0")
    assert 'ENTRYPOINT ["apex"]' in final
    assert "ARG BASE_IMAGE" in text and "TORCH_SPEC" in stages[0]
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M):
        for source in shlex.split(line)[:-1]:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
