"""deploy/kubernetes against the Kubernetes API's own schemas, offline, and the timing and
wiring rules its README states that tests/test_deploy.py does not already check.

No API server can run here, but its schemas can: kubernetes-validate (pinned in the test
extra) ships the JSON schemas derived from each release's OpenAPI spec; its strict variant
refuses unknown fields, as ``kubectl apply --validate=strict`` would. Every object is
validated against each release in K8S_VERSIONS (README, "What is checked"). What the
schemas cannot say (names that become DNS labels, the README's numbers, the launcher's own
launch check on the ConfigMap) is checked by hand below.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ft_monitor.core import timeout_order
from ft_monitor.core.settings import Settings
from tests.test_deploy import (
    K8S,
    configmap_config,
    k8s_objects,
    kill_escalation,
    launcher_args,
    launcher_container,
    pod_spec,
)

K8S_README = K8S.parent / "README.md"
K8S_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35", "1.36", "1.37")
"""Every release kubernetes-validate 1.37.0 ships from the first whose schema accepts a
podFailurePolicy rule without onPodConditions (1.25-1.28 require it in every rule)."""
KINDS = ("ConfigMap", "Service", "NetworkPolicy", "Job")
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
"""RFC 1035 label, as the API server requires of a Service name and of a pod hostname."""


def validate(obj: dict[str, Any], version: str) -> None:
    """Strict validation against exactly ``version``: the validator would otherwise fall back
    to an older schema it has, and say so only in its return value."""
    assert kubernetes_validate.validate(obj, version, strict=True) == version


def refusal(obj: dict[str, Any], version: str) -> tuple[str, str]:
    """(dotted path, message) of the validator's refusal of ``obj``."""
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        validate(obj, version)
    return ".".join(str(p) for p in info.value.path), info.value.message


def shutdown_timeout() -> float:
    """torch's wait between SIGTERM and SIGKILL of the workers in this pod, read as ft-launcher
    reads it: --shutdown-timeout, else the environment, else torch's default."""
    env = {e["name"]: e.get("value") for e in launcher_container().get("env", [])}
    value = launcher_args().get("--shutdown-timeout") or env.get(timeout_order.SHUTDOWN_TIMEOUT_ENV)
    return float(value) if value else timeout_order.TORCH_SHUTDOWN_TIMEOUT


# ---------------------------------------------------------------------------
# The API's schemas


def test_the_pinned_validator_ships_the_checked_versions() -> None:
    """A validator upgrade that drops a version fails here, not as a silent fallback."""
    assert kubernetes_validate.__version__ == "1.37.0"
    shipped = {v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()}
    assert set(K8S_VERSIONS) <= shipped


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_api_schema(version: str) -> None:
    """All four objects, each refusal named (kind, field, the validator's message)."""
    problems = []
    for kind, obj in k8s_objects().items():
        try:
            validate(obj, version)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{kind} {'.'.join(str(p) for p in e.path)}: {e.message}")
    assert not problems, f"Kubernetes {version}: " + "; ".join(problems)


def test_every_object_in_deploy_kubernetes_is_validated() -> None:
    docs = [d for p in sorted(K8S.parent.glob("*.y*ml")) for d in yaml.safe_load_all(p.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == sorted(KINDS)


@pytest.mark.parametrize(
    ("mutate", "path", "words"),
    [
        (lambda job: job["spec"]["template"]["spec"].update(terminationGracePeriodSecond=90),
         "spec.template.spec", ["'terminationGracePeriodSecond' was unexpected"]),
        (lambda job: job["spec"].update(parallelism="two"), "spec.parallelism", ["'two'", "integer"]),
        (lambda job: job["spec"]["template"]["spec"]["containers"][0].pop("name"),
         "spec.template.spec.containers.0", ["'name' is a required property"]),
    ],
    ids=["unknown-field", "wrong-type", "missing-required"],
)
def test_a_broken_copy_is_refused_naming_the_field(mutate: Any, path: str, words: list[str]) -> None:
    """The check can fail: a typo, a wrong type, a missing field, each found where it is."""
    job = copy.deepcopy(k8s_objects()["Job"])
    mutate(job)
    where, message = refusal(job, K8S_VERSIONS[-1])
    assert where == path, message
    for word in words:
        assert word in message


def test_before_1_29_the_schema_wants_onpodconditions_in_every_rule() -> None:
    """Why K8S_VERSIONS starts at 1.29 (README): the one thing the older schemas refuse."""
    where, message = refusal(k8s_objects()["Job"], "1.28")
    assert (where, message) == ("spec.podFailurePolicy.rules.0", "'onPodConditions' is a required property")


# ---------------------------------------------------------------------------
# What the schemas cannot check


def test_names_are_dns_labels_and_pod_hostnames_fit() -> None:
    """The Service name and each pod's hostname (<job name>-<index>) are DNS labels: 63
    characters at most, or the rendezvous host does not resolve."""
    objs = k8s_objects()
    job, service = objs["Job"], objs["Service"]
    assert DNS_LABEL.fullmatch(service["metadata"]["name"])
    last_host = f"{job['metadata']['name']}-{job['spec']['completions'] - 1}"
    assert DNS_LABEL.fullmatch(last_host) and len(last_host) <= 63
    for obj in objs.values():
        assert len(obj["metadata"]["name"]) <= 63


def test_the_rendezvous_port_reaches_the_container() -> None:
    """The Service's port for the endpoint targets a port the launcher's container declares."""
    port = int(launcher_args()["--rdzv-endpoint"].rsplit(":", 1)[1])
    (svc_port,) = [p for p in k8s_objects()["Service"]["spec"]["ports"] if p["port"] == port]
    target = svc_port.get("targetPort", port)
    declared = {p["containerPort"]: p.get("name") for p in launcher_container()["ports"]}
    assert target in declared or target in declared.values()
    assert port in declared


def test_the_launchers_own_launch_check_passes_on_the_configmap(tmp_path: Path) -> None:
    """ft-launcher checks the timeout orders at start (docs/configuration.md, "Timeouts in
    order"): with the ConfigMap's settings and this pod's shutdown wait, nothing is in the
    wrong order, and the pod's grace is the one the launcher is told."""
    cfg = configmap_config(tmp_path)
    assert cfg.scheduler_grace_time == pod_spec()["terminationGracePeriodSeconds"]
    # Set in the ConfigMap, so the order does not depend on which torch (NCCL or not) the image has.
    assert cfg.process_group_timeout is not None
    settings = Settings.from_config(cfg)
    known = timeout_order.facts(settings, {}, shutdown_timeout=shutdown_timeout())
    assert timeout_order.inversions(settings, known) == []


def test_the_launchers_check_would_catch_a_short_grace(tmp_path: Path) -> None:
    """The same check refuses a grace of exactly the launcher's stop: the test above can fail."""
    cfg = configmap_config(tmp_path)
    tight = cfg.model_copy(update={"scheduler_grace_time": kill_escalation(cfg)})
    settings = Settings.from_config(tight)
    known = timeout_order.facts(settings, {}, shutdown_timeout=shutdown_timeout())
    (found,) = timeout_order.inversions(settings, known)
    assert "terminationGracePeriodSeconds" in found.fix


def readme_section(title: str) -> str:
    text = K8S_README.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def test_the_readmes_termination_budget_is_the_manifests(tmp_path: Path) -> None:
    """The README's arithmetic, term by term, from the ConfigMap and the pod: it must change
    when they do."""
    cfg = configmap_config(tmp_path)
    grace = pod_spec()["terminationGracePeriodSeconds"]
    block = readme_section("Termination timing")
    m = re.search(r"=\s+(\d+) \+ (\d+) \+ (\d+) = (\d+) s\n.*=\s+(\d+) s\n"
                  r"terminationGracePeriodSeconds = (\d+) > (\d+)", block)
    assert m, block
    dump, grace_time, torch_wait, first, total, stated_grace, bound = (int(g) for g in m.groups())
    assert (dump, grace_time, torch_wait) == (cfg.stack_dump_timeout, cfg.termination_grace_time, shutdown_timeout())
    assert first == dump + grace_time + torch_wait
    assert total == bound == kill_escalation(cfg)
    assert stated_grace == grace > total
    assert f"scheduler_grace_time: {grace}" in block


def test_the_readme_names_the_manifests_objects_and_endpoint() -> None:
    """The names, endpoint and counts the README states are the manifest's (test_deploy.py
    checks the endpoint against the Job's and the Service's names)."""
    objs = k8s_objects()
    readme = K8S_README.read_text()
    endpoint = launcher_args()["--rdzv-endpoint"]
    assert f"`{endpoint}`" in readme
    for kind in KINDS:
        assert f"**{kind}** `{objs[kind]['metadata']['name']}`" in readme
    spec = objs["Job"]["spec"]
    assert f"backoffLimit: {spec['backoffLimit']}" in readme
    assert f"{spec['completions']} pods" in readme
    for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
        assert version in readme_section("What is checked")
