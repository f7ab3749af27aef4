"""The deployment fingerprint: a hash of exactly the spec fields that change what prefill and decode
servers exchange, so a server only ever pairs with peers of the same fingerprint.

In: the image (engine code: payload layout, state types), the model source and revision (weights and
shapes), device, dtype and page size (item sizes and page layout), the transfer protocol (both ends
must speak it), and each role's tensor- and expert-parallel sizes (how KV and experts are sharded).

Out, on purpose: replicas (scaling must not restart anything), resources, placement (nodeSelector,
tolerations, affinity), the router and its policies, the Service, the API key, probes, rollout and
Ascend host settings, engine limits that do not change the payload (maxModelLen, chunkedPrefillSize,
maxNumSeqs, ...), the served model name, and the resource's own name.

Changing an "in" field starts a new generation (new StatefulSets and router, named with the new
fingerprint) beside the serving one; changing an "out" field updates the current generation in place.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dsv4_operator.spec import Dsv4Deployment

# Bump when the inputs or their encoding change: every deployment then rolls once.
FINGERPRINT_VERSION = 1
LENGTH = 10


def fingerprint_inputs(dep: Dsv4Deployment) -> dict[str, Any]:
    spec = dep.spec
    model = spec.model
    if model.pvc is not None:
        source: dict[str, Any] = {"pvc": model.pvc.claim_name, "path": model.pvc.path or ""}
    elif model.host_path is not None:
        source = {"hostPath": model.host_path.path}
    else:
        source = {"image": model.image.path if model.image else ""}
    return {
        "version": FINGERPRINT_VERSION,
        "image": spec.image,
        "model": {**source, "revision": model.revision or ""},
        "device": spec.engine.device,
        "dtype": spec.engine.dtype,
        "pageSize": spec.engine.page_size,
        "transferProtocol": spec.engine.transfer_protocol,
        "prefill": {"tp": spec.prefill.tensor_parallel_size, "ep": spec.prefill.expert_parallel_size},
        "decode": {"tp": spec.decode.tensor_parallel_size, "ep": spec.decode.expert_parallel_size},
    }


def deployment_fingerprint(dep: Dsv4Deployment) -> str:
    """10 lowercase hex characters (a valid label value and name suffix)."""
    canonical = json.dumps(fingerprint_inputs(dep), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:LENGTH]
