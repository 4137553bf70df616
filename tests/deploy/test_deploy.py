"""deploy/: the compose file against the official Compose schema, its commands and the
Kubernetes manifests against apex's own CLI, the secure defaults (CURVE keys from a keygen
service, ports published on loopback), and the Dockerfile's promises."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from apex import config
from apex.cli import ENV, build_parser
from tests.support.paths import ROOT

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


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.ranks.yml"])
def test_compose_files_validate_against_the_compose_spec(schema, name):
    jsonschema.Draft7Validator(schema).validate(compose(name))


def test_compose_settings_come_from_the_environment_with_defaults(schema):
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    used = set(VARIABLE.findall((DEPLOY / "docker-compose.yml").read_text()))
    assert {name for name, _ in used} == set(example), "every setting is in .env.example, and only those"
    assert all(default is not None for _, default in used)
    custom = compose(env={**example, "APEX_ACTORS": "8", "APEX_HOST_PORTS": "7000-7002"})
    jsonschema.Draft7Validator(schema).validate(custom)
    assert custom["services"]["actor"]["deploy"]["replicas"] == "8"
    assert custom["services"]["learner"]["ports"] == ["127.0.0.1:7000-7002:5550-5552"]
    # The documented way to reach the learner from other hosts: publish on every interface.
    everywhere = compose(env={"APEX_PUBLISH_HOST": "0.0.0.0"})
    jsonschema.Draft7Validator(schema).validate(everywhere)
    assert everywhere["services"]["learner"]["ports"] == ["0.0.0.0:5550-5552:5550-5552"]
    assert everywhere["services"]["tensorboard"]["ports"] == ["127.0.0.1:6006:6006"]  # its own setting
    # A host directory of keys instead of the named volume.
    own_keys = compose(env={"APEX_KEYS": "/srv/apex-keys"})
    jsonschema.Draft7Validator(schema).validate(own_keys)
    for name in ("keygen", "learner", "actor"):
        assert any(v.startswith("/srv/apex-keys:/keys") for v in own_keys["services"][name]["volumes"])


def test_compose_services_run_apex_commands_that_parse():
    services = compose()["services"]
    parser = build_parser()
    learner = parser.parse_args(services["learner"]["command"])
    assert learner.command == "learner" and learner.port == 5550 and learner.bind_host == "0.0.0.0"
    assert learner.logdir.startswith("/runs/")
    actor = parser.parse_args(services["actor"]["command"])
    assert actor.command == "actor" and actor.learner == "learner:5550"  # the learner's service name
    # The learner's config is a preset by name: configs/ ships in the wheel as apex.configs.
    assert learner.config in config.presets()
    for service in services.values():
        assert set(service.get("environment", {})) <= set(ENV.values())
    assert "ports" not in services["actor"] and "container_name" not in services["actor"]  # it scales
    assert services["tensorboard"]["profiles"] == ["tensorboard"]
    assert "5550-5552" in services["learner"]["ports"][0] and services["learner"]["healthcheck"]["test"]


def test_compose_ranks_overlay_runs_a_two_rank_learner_that_parses():
    ranks = compose("docker-compose.ranks.yml")["services"]["learner"]
    learner = build_parser().parse_args(ranks["command"])
    assert learner.ranks == 2 and learner.port == 5550 and learner.auto_resume and learner.bind_host == "0.0.0.0"
    # rank 1's trajectories: P+3, published on loopback like the rest
    assert ranks["ports"] == ["127.0.0.1:5553:5553"]
    base = compose()["services"]["learner"]["command"]
    assert ranks["command"][: len(base)] == base  # the same learner, plus --ranks


def published_host(port_spec: str) -> str:
    """The host address of a short-syntax port mapping, HOST:PUBLISHED:TARGET ('' if none)."""
    parts = port_spec.rsplit(":", 2)
    return parts[0] if len(parts) == 3 else ""


def test_compose_publishes_every_port_on_loopback_by_default():
    services = compose()["services"]
    published = [(name, spec) for name, service in services.items() for spec in service.get("ports", [])]
    assert {name for name, _ in published} == {"learner", "tensorboard"}
    for name, spec in published:
        assert published_host(spec) == "127.0.0.1", f"{name} publishes {spec} beyond loopback"
    assert services["learner"]["ports"] == ["127.0.0.1:5550-5552:5550-5552"]
    assert services["tensorboard"]["ports"] == ["127.0.0.1:6006:6006"]


def keys_mount(service: dict) -> tuple[str, str, str]:
    """(source, target, mode) of the service's volume mounted on /keys."""
    (mount,) = [v for v in service.get("volumes", []) if v.split(":")[1] == "/keys"]
    source, target, *mode = mount.split(":")
    return source, target, mode[0] if mode else "rw"


def keygen_line() -> str:
    keygen = compose()["services"]["keygen"]
    assert keygen["entrypoint"] == ["/bin/sh", "-c"]
    (line,) = keygen["command"]
    return line


def test_compose_runs_with_curve_keys_from_a_keygen_service(tmp_path):
    from apex.transport import generate_keys

    spec = compose()
    services = spec["services"]
    keygen = services["keygen"]
    assert keygen["image"] == services["learner"]["image"] == services["actor"]["image"]
    assert keygen.get("restart", "no") == "no" and "ports" not in keygen and "deploy" not in keygen
    # It runs as the image's user (no `user:` override), the user the learner and actors run as,
    # so the 0600 secret keys it writes are readable by them.
    assert all("user" not in s for s in services.values())
    source, target, mode = keys_mount(keygen)
    assert (target, mode) == ("/keys", "rw")
    assert source in spec["volumes"], "the default key store is a named volume of this file"
    for name in ("learner", "actor"):
        service = services[name]
        assert keys_mount(service) == (source, "/keys", "ro"), f"{name} mounts the keys read-only"
        assert service["environment"]["APEX_CURVE_DIR"] == "/keys"
        assert service["depends_on"]["keygen"] == {"condition": "service_completed_successfully"}
    assert services["actor"]["depends_on"]["learner"]["condition"] == "service_started"

    # The shell line: keygen only where there are no keys yet; `apex keygen` must parse.
    check, run = (part.strip() for part in keygen_line().split("||"))
    test_cmd = shlex.split(check)
    assert test_cmd[:2] == ["test", "-f"]
    written = generate_keys(tmp_path / "keys")
    assert Path(test_cmd[2]) == Path(target) / written["learner_secret"].name
    program, *argv = shlex.split(run)
    assert program == "apex"
    args = build_parser().parse_args(argv)
    assert args.command == "keygen" and args.dir == target


def test_compose_keygen_line_writes_keys_once(tmp_path):
    """The keygen service's shell line, run by sh against a real `apex keygen`: the first run
    writes the keys, later runs succeed without touching them (apex keygen alone would refuse)."""
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "apex"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m apex "$@"\n')
    shim.chmod(0o755)
    keys = tmp_path / "keys"
    keys.mkdir()  # a fresh volume: an empty directory
    line = keygen_line().replace("/keys", str(keys))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run_line():
        return subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, timeout=120)

    first = run_line()
    assert first.returncode == 0, first.stderr
    names = {"learner.key", "learner.key_secret", "actor.key", "actor.key_secret"}
    assert names <= {p.name for p in keys.iterdir()} and (keys / "authorized" / "actor.key").exists()
    before = {p: p.read_bytes() for p in keys.rglob("*") if p.is_file()}
    second = run_line()
    assert second.returncode == 0, second.stderr
    assert {p: p.read_bytes() for p in keys.rglob("*") if p.is_file()} == before


def test_dockerfile_gives_the_image_user_the_key_directory():
    """A fresh named volume takes the owner of the image's directory it is mounted on: /keys
    must exist in the image and belong to the user keygen, the learner and the actors run as."""
    final = re.split(r"^FROM ", (DEPLOY / "Dockerfile").read_text(), flags=re.M)[-1]
    user = re.search(r"^USER (\S+)", final, flags=re.M).group(1)
    run = " ".join(re.findall(r"^RUN ((?:.*\\\n)*.*)$", final, flags=re.M)).replace("\\\n", " ")
    assert re.search(r"mkdir -p [^&]*/keys", run)
    assert re.search(rf"chown {user} [^&]*/keys", run)


K8S_BASE = DEPLOY / "k8s" / "base"


def k8s_documents() -> dict[str, dict]:
    docs = {}
    for path in K8S_BASE.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if "kind" not in doc:
                continue  # apex-config.yaml: apex's own config, checked below
            docs[f"{doc['kind']}/{doc.get('metadata', {}).get('name', path.stem)}"] = doc
    return docs


def test_kubernetes_manifests_agree_with_each_other_and_the_cli():
    docs = k8s_documents()
    kustomization = docs["Kustomization/kustomization"]
    for resource in kustomization["resources"]:
        assert (K8S_BASE / resource).exists()
    (config_file,) = kustomization["configMapGenerator"][0]["files"]
    mounted_name, source = config_file.split("=")
    config.load(K8S_BASE / source)  # a valid apex config
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
    actor = yaml.safe_load((DEPLOY / "k8s" / "curve" / "actor-curve.yaml").read_text())
    actor_items = actor["spec"]["template"]["spec"]["volumes"][0]["secret"]["items"]
    assert {i["key"] for i in actor_items} == {"learner.key", "actor.key_secret"}  # no learner secret


def kustomization_dirs(directory: Path) -> list[Path]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [(directory / r).resolve() for r in spec.get("resources", []) if (directory / r).is_dir()]


@pytest.mark.parametrize("overlay", ["k8s", "k8s/curve", "k8s/ranks"])
def test_kubernetes_kustomizations_reference_no_base_that_contains_them(overlay):
    """kustomize refuses a base directory that contains the overlay ("cycle detected")."""
    directory = (DEPLOY / overlay).resolve()
    bases = kustomization_dirs(directory)
    assert bases
    for base in bases:
        assert (base / "kustomization.yaml").exists()
        assert not directory.is_relative_to(base), f"{overlay} lies inside its base {base}"
    assert (DEPLOY / "k8s" / "base").resolve() in bases


def test_kubernetes_ranks_overlay_runs_a_two_rank_learner_behind_the_service():
    deployment, service = yaml.safe_load_all((DEPLOY / "k8s" / "ranks" / "learner-ranks.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    learner = build_parser().parse_args(container["args"])
    assert learner.ranks == 2 and learner.port == 5550 and learner.auto_resume
    base = yaml.safe_load_all((K8S_BASE / "learner.yaml").read_text())
    assert container["args"][:-2] == next(base)["spec"]["template"]["spec"]["containers"][0]["args"]
    # rank 1's trajectories: P+3, in the pod and behind the Service
    assert container["ports"] == [{"name": "trajectories-1", "containerPort": 5553}]
    assert service["metadata"]["name"] == "apex-learner" and service["spec"]["ports"][0]["port"] == 5553
    comments = " ".join(
        line.lstrip("# ")
        for line in (DEPLOY / "k8s" / "ranks" / "kustomization.yaml").read_text().splitlines()
        if line.startswith("#")
    )
    assert "must not be reachable from untrusted networks" in " ".join(comments.split())


def test_kubernetes_default_manifests_warn_that_they_run_without_curve():
    for path in (DEPLOY / "k8s" / "kustomization.yaml", K8S_BASE / "kustomization.yaml", K8S_BASE / "learner.yaml"):
        comments = [line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#")]
        text = " ".join(" ".join(comments).split())
        assert "must not be reachable from untrusted networks" in text, path
        assert "curve" in text


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kubernetes_kustomizations_build(tmp_path):
    """`kubectl kustomize` builds the base and the curve overlay (with keys from apex keygen)."""
    from apex.transport import generate_keys

    copy = tmp_path / "k8s"
    shutil.copytree(DEPLOY / "k8s", copy, ignore=shutil.ignore_patterns("keys"))
    generate_keys(copy / "curve" / "keys")

    def build(directory: Path) -> list[dict]:
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return list(yaml.safe_load_all(out.stdout))

    base = build(copy)
    assert {d["kind"] for d in base} == {"ConfigMap", "Service", "Deployment"}
    ranks = {d["metadata"]["name"] + d["kind"]: d for d in build(copy / "ranks")}
    learner = ranks["apex-learnerDeployment"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["args"][-2:] == ["--ranks", "2"] and len(learner["ports"]) == 4
    assert {p["port"] for p in ranks["apex-learnerService"]["spec"]["ports"]} == {5550, 5551, 5552, 5553}
    curve = build(copy / "curve")
    (secret,) = [d for d in curve if d["kind"] == "Secret"]
    assert set(secret["data"]) == {"learner.key", "learner.key_secret", "actor.key", "actor.key_secret"}
    for deployment in (d for d in curve if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert {"name": "APEX_CURVE_DIR", "value": "/etc/apex-keys"} in container["env"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]


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
            # ${ARG:-default}: a build argument (WHEELHOUSE), checked at its default.
            source = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", source)
            assert (ROOT / source).exists(), f"COPY source {source} is missing"


def test_the_kuberay_rayjob_runs_apex_on_ray_with_a_command_that_parses():
    (job,) = yaml.safe_load_all((DEPLOY / "k8s" / "ray" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    args = build_parser().parse_args(job["spec"]["entrypoint"].split()[1:])
    assert args.command == "run" and args.ray == "auto" and args.config in config.presets()
    cluster = job["spec"]["rayClusterSpec"]
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]]
    containers += [group["template"]["spec"]["containers"][0] for group in cluster["workerGroupSpecs"]]
    assert {c["image"] for c in containers} == {"apex"}  # the image with the ray extra
    assert job["spec"]["shutdownAfterJobFinishes"] is True  # nothing left on the cluster
