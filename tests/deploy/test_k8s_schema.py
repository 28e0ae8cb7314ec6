"""Every object deploy/k8s renders is valid Kubernetes, checked offline against the API's schemas.

`kubernetes-validate` ships the OpenAPI schemas of every Kubernetes release; strict mode also
rejects fields the API does not know (a misspelt `apProtocol` would otherwise be dropped silently by
the API server). The oldest version checked is the oldest the manifests support (1.30: the
preStop `sleep` action); the newest is the newest the package knows.
"""

from __future__ import annotations

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (test extra)")

OLDEST_SUPPORTED = "1.30"
EXPECTED = {("StatefulSet", "tandem-engine"), ("Service", "tandem-engine"), ("PodDisruptionBudget", "tandem-engine"),
            ("NetworkPolicy", "tandem-engine"), ("Deployment", "tandem-frontend"), ("Service", "tandem-frontend"),
            ("PodDisruptionBudget", "tandem-frontend"), ("HorizontalPodAutoscaler", "tandem-frontend"),
            ("NetworkPolicy", "tandem-frontend")}


@pytest.mark.parametrize("version", [OLDEST_SUPPORTED, kubernetes_validate.latest_version()])
def test_every_object_validates_against_the_kubernetes_schemas(rendered, version):
    errors = []
    for doc in rendered.docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} {path}: {exc.message}")
    assert not errors, f"{rendered.overlay} overlay, Kubernetes {version}:\n" + "\n".join(errors)


def test_each_overlay_renders_the_whole_stack_in_one_namespace(rendered):
    objects = {(doc["kind"], doc["metadata"]["name"]) for doc in rendered.docs if doc["kind"] != "ConfigMap"}
    assert objects == EXPECTED
    assert {doc["metadata"].get("namespace") for doc in rendered.docs} == {"tandem"}
    assert all(doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tandem" for doc in rendered.docs)
