"""examples/autoscaling/decode-hpa.yaml: a valid autoscaling/v2 HPA that targets the Dsv4Deployment's
scale subresource (spec.decode.replicas) on a per-pod series the servers export."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import yaml

from dsv4_operator.crd import load_crd
from dsv4_operator.spec_types import API_VERSION, KIND

from .series import known_series

HPA = Path(__file__).resolve().parents[2] / "examples" / "autoscaling" / "decode-hpa.yaml"


def test_the_hpa_scales_decode_through_the_scale_subresource_on_an_exported_series() -> None:
    text = HPA.read_text()
    hpa = yaml.safe_load(text)
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (API_VERSION, KIND)
    (version,) = load_crd()["spec"]["versions"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"  # per decode pod, averaged over the scale selector's pods
    # The adapter rule in the comment maps vllm:NAME to vllm_NAME: the series must exist.
    (series,) = re.findall(r"seriesQuery: '([a-z_:]+)\{", text)
    assert series in known_series()
    assert metric["pods"]["metric"]["name"] == "vllm_" + series.removeprefix("vllm:")
