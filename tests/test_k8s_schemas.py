"""``persia-launcher k8s`` output is valid Kubernetes: every object against the API schemas of
``KUBERNETES_VERSION`` (kubernetes-validate ships them; no network), the API server's
naming rules the schemas do not carry, and the image the manifests name is the Dockerfile's,
installed as the README's quick start installs persia_py."""

from __future__ import annotations

import itertools
import re
import shlex

import kubernetes_validate
import pytest
from checkout import ROOT
from test_k8s import FLAGS, _render

from persia_py.launcher.k8s_flags import MAX_JOB_NAME
from persia_py.launcher.k8s_objects import KUBERNETES_VERSION

BASE = FLAGS[:FLAGS.index("--num-ps")]  # job, image, configs, scripts; no counts or sizes
SECURITY = {  # token (generated / referenced / none) x TLS (none / a Secret)
    "token": [], "token-tls": ["--tls-secret-name", "ctr-tls"],
    "secret": ["--auth-secret-name", "team-token"],
    "secret-tls": ["--auth-secret-name", "team-token", "--tls-secret-name", "ctr-tls"],
    "insecure": ["--insecure"], "insecure-tls": ["--insecure", "--tls-secret-name", "ctr-tls"],
}
ROLE_FLAGS = ("--num-ps", "--num-embedding-workers", "--num-nn-worker-nodes", "--num-data-loaders")


def _combinations() -> list[tuple[str, list[str]]]:
    """Each security setting once, with 1-4 of each role, GPUs or none, 1-8 ranks per pod."""
    cases = []
    for i, (name, security) in enumerate(SECURITY.items()):
        counts = [str((i + shift) % 4 + 1) for shift in range(len(ROLE_FLAGS))]
        gpus = (0, 1, 8)[i % 3]
        flags = [*BASE, *security, *itertools.chain(*zip(ROLE_FLAGS, counts)),
                 "--nproc-per-node", str(max(gpus, 1)), "--nn-worker-gpus", str(gpus)]
        cases.append((f"{name}-{'x'.join(counts)}-gpus{gpus}", flags))
    return cases


def _schema_errors(objects: list[dict]) -> list[str]:
    errors = []
    for obj in objects:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        try:
            used = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        else:  # not an older release's schemas standing in for the one named
            assert used == KUBERNETES_VERSION, (where, used)
    return errors


@pytest.mark.parametrize("flags", [f for _, f in _combinations()],
                         ids=[name for name, _ in _combinations()])
def test_every_object_validates_against_the_kubernetes_api_schemas(flags: list[str]) -> None:
    objects = _render(*flags)  # as kubectl reads them: parsed back from the YAML text
    assert {o["kind"] for o in objects} >= {"NetworkPolicy", "ConfigMap", "Service",
                                            "StatefulSet", "Job"}
    assert _schema_errors(objects) == []


def test_the_schemas_catch_an_unknown_field() -> None:
    objects = _render(*FLAGS)
    (job,) = [o for o in objects if o["kind"] == "Job"]
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a typo for resources
    assert _schema_errors([job]) == [
        "Job ctr-nn-worker: spec.template.spec.containers.0: Additional properties are not "
        "allowed ('resource' was unexpected)"]


# -- what the API server checks beyond the schemas ------------------------------------------

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # RFC 1123, at most 63
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names, at most 63
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")  # at most 63
_PORT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # IANA service name, at most 15
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REVISION_HASH = 1 + 10  # a StatefulSet's controller-revision-hash: <name>-<hash>


def _name_errors(objects: list[dict]) -> list[str]:
    def check(ok: bool, what: str) -> None:
        if not ok:
            errors.append(what)

    errors: list[str] = []
    for obj in objects:
        name, kind, spec = obj["metadata"]["name"], obj["kind"], obj.get("spec", {})
        check(_DNS_LABEL.match(name) and len(name) <= 63, f"{kind} name {name!r}")
        if kind == "Service":
            check(_DNS_1035.match(name), f"Service name {name!r} must start with a letter")
        labels = dict(obj["metadata"]["labels"])
        pods = 0
        if kind == "StatefulSet":
            pods = spec["replicas"]
            labels["controller-revision-hash"] = name + "x" * _REVISION_HASH
        elif kind == "Job":
            pods = spec["completions"]
            labels["batch.kubernetes.io/job-name"] = name
        # Pod names (and hostnames) are <name>-<ordinal or index>.
        check(len(f"{name}-{pods - 1}") <= 63, f"{kind} {name}: pod names over 63 characters")
        for value in labels.values():
            check(_LABEL_VALUE.match(value) and len(value) <= 63, f"{kind} {name}: label {value!r}")
        for container in spec.get("template", {}).get("spec", {}).get("containers", []):
            for port in container["ports"]:
                check(_PORT_NAME.match(port["name"]) and len(port["name"]) <= 15,
                      f"{kind} {name}: port name {port['name']!r}")
            for env in container["env"]:
                check(_ENV_NAME.match(env["name"]), f"{kind} {name}: env {env['name']!r}")
    return errors


def _with_job_name(job_name: str) -> list[str]:
    flags = [*FLAGS, "--tls-secret-name", "ctr-tls"]
    flags[flags.index("--job-name") + 1] = job_name
    return flags


def test_names_stay_within_the_api_servers_limits_at_the_longest_job_name() -> None:
    objects = _render(*_with_job_name("j" * MAX_JOB_NAME))
    assert _name_errors(objects) == []
    # One character more would break the embedding workers' StatefulSet, so it is refused.
    for obj in objects:
        obj["metadata"]["name"] = "j" + obj["metadata"]["name"]
    assert _name_errors(objects) == [
        f"StatefulSet {'j' * (MAX_JOB_NAME + 1)}-embedding-worker: label "
        f"'{'j' * (MAX_JOB_NAME + 1)}-embedding-workerxxxxxxxxxxx'"]
    for bad in ("j" * (MAX_JOB_NAME + 1), "1ctr"):  # a Service name starts with a letter
        with pytest.raises(SystemExit, match="--job-name"):
            _render(*_with_job_name(bad))


def test_gpus_are_limits_of_the_nn_worker_pods_only() -> None:
    for gpus in (0, 2):
        objects = _render(*FLAGS, "--nn-worker-gpus", str(gpus))
        for obj in objects:
            if obj["kind"] in ("StatefulSet", "Job"):
                (container,) = obj["spec"]["template"]["spec"]["containers"]
                limits = container["resources"].get("limits", {})
                wanted = gpus if obj["kind"] == "Job" and gpus else None
                assert limits.get("nvidia.com/gpu") == wanted, obj["metadata"]["name"]


# -- docs: the Kubernetes release, the image ------------------------------------------------

def _readme_section(title: str, page: str = "docs/deployment.md") -> str:
    readme = (ROOT / page).read_text()
    return readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_names_the_kubernetes_release_the_tests_validate_against() -> None:
    section = _readme_section("Running on Kubernetes")
    assert f"Kubernetes {KUBERNETES_VERSION}" in section
    assert f"at most {MAX_JOB_NAME} characters" in section


def _commands(lines: list[str]) -> list[list[str]]:
    """Shell commands of ``lines`` (continuations joined; split at ``&&``, ``||`` and pipes;
    redirections dropped), as argv lists."""
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|\|\|?", line):
            argv = [a for a in shlex.split(part, comments=True) if not re.match(r"\d*[<>]", a)]
            if argv:
                commands.append(argv)
    return commands


def _pip_install(argv: list[str]) -> dict:
    """What a ``pip install`` command installs: constraints, packages, indexes."""
    argv = argv[argv.index("install") + 1:]
    found: dict = {"constraints": [], "packages": [], "indexes": []}
    values = iter(argv)
    for arg in values:
        if arg in ("-c", "--constraint"):
            found["constraints"].append(next(values))
        elif arg in ("--extra-index-url", "--index-url", "-i"):
            found["indexes"].append(next(values))
        elif arg == "-e":
            found["packages"].append(next(values))
        elif not arg.startswith("-"):
            found["packages"].append(arg)
    return found


def _split_extras(package: str) -> tuple[str, set[str]]:
    path, _, extras = package.partition("[")
    return path, {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}


def _with_arg_defaults(text: str) -> str:
    """A Dockerfile as built without --build-arg: each ``${NAME}`` replaced by the default
    of its ``ARG NAME=default``."""
    for name, default in re.findall(r"^ARG (\w+)=(\S+)$", text, re.M):
        text = text.replace(f"${{{name}}}", default)
    return text


def test_the_dockerfile_installs_persia_py_as_the_quick_start_does() -> None:
    dockerfile = _with_arg_defaults((ROOT / "Dockerfile").read_text()).splitlines()
    runs = [c[1:] for c in _commands(dockerfile) if c and c[0] == "RUN"]
    (image,) = [_pip_install(c) for c in runs if c[:2] == ["pip", "install"]]
    # The quick start's scripts both install through scripts/setup_env.sh.
    quick_start = _readme_section("Quick start", "README.md")
    for script in re.findall(r"^bash (scripts/\S+\.sh)", quick_start, re.M):
        assert "bash scripts/setup_env.sh" in (ROOT / script).read_text(), script
    setup_env = (ROOT / "scripts" / "setup_env.sh").read_text().splitlines()
    (local,) = [_pip_install(c) for c in _commands(setup_env) if "install" in c]

    assert image["constraints"] == local["constraints"] == ["requirements/cpu-constraints.txt"]
    assert f"(`{local['constraints'][0]}`)" in quick_start
    (image_package,), (local_package,) = image["packages"], local["packages"]
    (image_path, image_extras), (local_path, local_extras) = map(
        _split_extras, (image_package, local_package))
    assert image_path == local_path == "."  # the repository itself, not a published release
    assert image_extras <= local_extras - {"test"}  # the image has no test tools
    # The image's index of CPU torch wheels: the constraints pin the version, not the build.
    assert image["indexes"] == ["https://download.pytorch.org/whl/cpu"]

    # What `pip install .` reads is in the image: setup.cfg's packages and package_dir.
    copied = {path for c in _commands(dockerfile) if c and c[0] == "COPY" for path in c[1:-1]}
    setup_cfg = (ROOT / "setup.cfg").read_text()
    dirs = set(re.findall(r"^\s+\S+ = (\w+)$", setup_cfg, re.M)) | {"persia_py"}
    assert dirs | {"setup.cfg", "pyproject.toml", "README.md", "requirements"} <= copied


def test_the_readme_builds_the_image_the_example_manifests_name() -> None:
    section = _readme_section("Running on Kubernetes")
    (build,) = re.findall(r"^docker build -t (\S+) \.", section, re.M)
    assert f"--image {build} " in section
    # The Dockerfile's own header says the same command.
    assert "docker build -t REGISTRY/persia-py:TAG ." in (ROOT / "Dockerfile").read_text()
    # The example's scripts are in the image, where the manifests say.
    assert "COPY examples /app/examples" in (ROOT / "Dockerfile").read_text()
    scripts = re.findall(r"/app/(\S+\.py)", section)
    assert scripts and all((ROOT / script).is_file() for script in scripts
                           if script.startswith("examples/")), scripts
    # A job's own scripts: in the image built FROM the project's, where its COPY puts them.
    (copied,) = re.findall(r"^COPY (.+) /app/job/$", section, re.M)
    assert all(s.removeprefix("job/") in copied.split() for s in scripts
               if not s.startswith("examples/")), (scripts, copied)
