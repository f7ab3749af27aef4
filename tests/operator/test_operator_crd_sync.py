"""The operator's CRD upgrade rule (crd_sync.py), as pure decisions: apply the bundled CRD over an
absent, unstamped, older or drifted one; leave a current one; never replace one a newer operator
stamped. The same rule on a real API server: tests/kube/test_kube_operator.py."""

from __future__ import annotations

import copy

from dsv4_operator import crd_sync
from dsv4_operator.crd import CEL_KEY


def _has_cel(node: object) -> bool:
    if isinstance(node, dict):
        return CEL_KEY in node or any(_has_cel(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_cel(v) for v in node)
    return False


def test_versions_order_by_release_numbers() -> None:
    key = crd_sync.version_key
    assert key("0.10.0") > key("0.9.3") > key("0.9") and key("1.0.0rc1") == key("1.0.0")
    assert key("0.1.0+local") == (0, 1, 0)


def test_the_cel_rules_go_only_to_servers_that_store_them() -> None:
    assert _has_cel(crd_sync.desired_crd("0.1.0", (1, 25)))
    old = crd_sync.desired_crd("0.1.0", (1, 20))
    assert not _has_cel(old)
    assert old["metadata"]["annotations"][crd_sync.VERSION_ANNOTATION] == "0.1.0"


def test_what_the_operator_does_with_the_live_crd() -> None:
    want = crd_sync.desired_crd("0.2.0", (1, 20))

    def stamped(crd: dict, version: str) -> dict:
        return {**crd, "metadata": {**crd["metadata"], "annotations": {crd_sync.VERSION_ANNOTATION: version}}}

    assert crd_sync.decide(None, want) == "apply"
    assert crd_sync.decide(copy.deepcopy(want), want) == "current"
    unstamped = copy.deepcopy(want)
    del unstamped["metadata"]["annotations"]
    assert crd_sync.decide(unstamped, want) == "apply"  # as helm's crds/ installed it
    assert crd_sync.decide(stamped(want, "0.1.9"), want) == "apply"
    older = copy.deepcopy(want)
    del older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "monitoring"
    ]
    assert crd_sync.decide(stamped(older, "0.2.0"), want) == "apply"  # same stamp, drifted content
    assert crd_sync.decide(stamped(older, "0.3.0"), want) == "newer"  # never downgraded
