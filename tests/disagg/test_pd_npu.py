"""PD with the NPU kernel set: `dsv4 serve --device npu` prefill and decode servers, with the reference
torch_npu importable in them (tests/npu/reference, as the real one is in the Ascend image), move a
request's state over Mooncake and answer exactly as a colocated CPU server does.

On a CPU the state moves over Mooncake's TCP transport: the reference's "npu" memory is host memory,
which TCP can read. With DSV4_TORCH_NPU=real on an Ascend node the same test runs the real torch_npu
over `--transfer-protocol ascend` (4 NPUs). On the reference it shows everything around the transport on the
NPU path: the pools' device buffers registered and read by page, the staging copies, the MTP window
the prefill's drafts need, the first decode step's metadata on the device, and the decode captured as
aclgraphs replaying transferred state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dsv4_engine.testing import random_ids

REFERENCE = str(Path(__file__).parents[1] / "npu" / "reference")
REAL = os.environ.get("DSV4_TORCH_NPU") == "real"  # on an Ascend node (docs/npu.md, "Verify on an A3 node")
LENGTHS = [1, 17, 130, 515]  # one token; past the window; past a page and ratio 128; several chunks
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(spawn: Any, pd: Any) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (None if REAL else REFERENCE, os.environ.get("PYTHONPATH")) if p)
    # float32: the CPU server's dtype, so tokens compare. On hardware each server sees NPUs of its own
    # (as a pod does) and the state goes over the Ascend transport; here every server has the
    # reference's "npu" devices, whose host memory TCP reads.
    npu = ("--device", "npu", "--dtype", "float32", "--transfer-protocol", "ascend" if REAL else "tcp")

    def env(visible: str) -> dict[str, str]:
        return {"PYTHONPATH": path, **({"ASCEND_RT_VISIBLE_DEVICES": visible} if REAL else {})}

    spec = ("--speculative-num-steps", "2")  # the MTP layer drafts on both legs; greedy output stays
    servers = {
        "P": spawn("npu-P", *npu, *spec, "--disaggregation-mode", "prefill", "--chunked-prefill-size", "128",
                   env=env("0")),
        # Two ranks: each receives its copy of the state on its own transport, and decodes as aclgraphs
        # with the all-reduces captured.
        "D": spawn("npu-D", *npu, *spec, "--disaggregation-mode", "decode", "--no-enforce-eager",
                   "--max-num-seqs", "4", "--tp-size", "2", env=env("1,2")),
        "N": spawn("npu-N", *npu, *spec, env=env("3")),  # colocated, on the NPU kernel set: seeded draws compare
        "C": spawn("cpu-C", "--device", "cpu"),
    }  # fmt: skip
    pd.wait_healthy(*servers.values())
    servers["initial"] = {s.name: s.free_pages() for s in servers.values()}
    return servers


def test_pd_on_the_npu_kernel_set_equals_a_colocated_cpu_server(cluster: dict[str, Any], pd: Any) -> None:
    prefill, decode = cluster["P"], cluster["D"]
    assert "device: npu" in prefill.log() and "device: npu" in decode.log()
    assert "decode bucket 4: captured" in decode.log(), decode.log()[-3000:]
    assert "rank 1: process groups prewarmed" in decode.log()  # the decode's second rank
    greedy = {"temperature": 0, "ignore_eos": True}
    drafts = decode.engine()["spec_decode_num_draft_tokens"]
    for n in LENGTHS:
        prompt = random_ids(n, seed=n)
        want = pd.generate(cluster["C"], prompt, MAX_TOKENS, **greedy)
        assert pd.pd_generate(prefill, decode, prompt, MAX_TOKENS, **greedy) == want, n
    assert decode.engine()["spec_decode_num_draft_tokens"] > drafts  # the decode verified drafts
    # A seeded sample: the prefill draws the first token, the decode the rest, from NPU generators
    # (Philox, not the CPU's Mersenne Twister): what one NPU server draws colocated.
    sampling = {"temperature": 1.0, "top_k": 50, "sampling_seed": 7, "ignore_eos": True}
    prompt = random_ids(300, seed=3)
    want = pd.generate(cluster["N"], prompt, MAX_TOKENS, **sampling)
    assert pd.pd_generate(prefill, decode, prompt, MAX_TOKENS, **sampling) == want
    assert want != pd.generate(cluster["N"], prompt, MAX_TOKENS, **{**sampling, "sampling_seed": 8})
    pd.settle(prefill, decode, initial=cluster["initial"])
