"""`dsv4 serve --device npu` as its own process, with the reference torch_npu importable in it (as the
real one is in the Ascend image), answering a greedy chat completion through the official `openai`
client with the text a `--device cpu` server gives; and HF transformers' Ascend integration, which
the server's process imports once torch_npu is importable, computing with the reference's
`npu_fusion_attention` what torch's attention computes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

DEMO = Path(__file__).parents[2] / "engine" / "dsv4_engine" / "data" / "demo"
REFERENCE = str(Path(__file__).parent / "reference")
REAL = os.environ.get("DSV4_TORCH_NPU") == "real"  # as conftest.py: the real torch_npu is installed
START_TIMEOUT = 90.0


def _env(npu: bool = True) -> dict[str, str]:
    """The test's environment; with `npu`, the reference first on the path (unless the real
    torch_npu is tested, which the environment already imports)."""
    path = [p for p in (REFERENCE if npu and not REAL else None, os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


class Servers:
    """`dsv4 serve --model DEMO ARGS` processes on free 127.0.0.1 ports, their output in files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}

    def start(self, *args: str, npu: bool) -> str:
        """Launch one (not waiting for it), with torch_npu importable if `npu`; returns its base URL."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = self.folder / f"serve-{port}.log"
        cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())"]
        cmd += ["serve", "--model", str(DEMO), "--host", "127.0.0.1", "--port", str(port), *args]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(npu))
        base = f"http://127.0.0.1:{port}"
        self.procs[base] = (proc, log)
        return base

    def log(self, base: str) -> str:
        return self.procs[base][1].read_text(errors="replace")

    def wait(self, base: str) -> None:
        proc = self.procs[base][0]
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"dsv4 serve exited {proc.returncode}:\n{self.log(base)[-4000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"dsv4 serve did not become healthy:\n{self.log(base)[-4000:]}")

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    started = Servers(tmp_path)
    yield started
    started.stop()


def test_serve_on_npu_answers_as_the_cpu_server(servers: Servers) -> None:
    """Both servers start at once; the NPU one decodes with aclgraphs (one capture per bucket, at
    start-up), the CPU one eagerly: the same greedy answer either way."""
    import openai

    npu = servers.start("--device", "npu", "--no-enforce-eager", "--max-num-seqs", "2", npu=True)
    cpu = servers.start("--device", "cpu", "--max-num-seqs", "2", npu=False)  # a plain CPU server
    servers.wait(npu)
    servers.wait(cpu)
    messages = [{"role": "user", "content": "What does a class definition define?"}]
    answers = []
    for base in (npu, cpu):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=str(DEMO),
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=16,
        )
        choice = reply.choices[0]
        answers.append(
            (
                choice.message.content,
                choice.finish_reason,
                reply.usage.completion_tokens if reply.usage else None,
            )
        )
    assert answers[0][0] and answers[0] == answers[1]
    log = servers.log(npu)
    assert "device: npu" in log and "decode bucket 2: captured" in log, log[-3000:]


@pytest.mark.skipif(REAL, reason="runs the reference's npu_fusion_attention")
def test_transformers_ascend_integration_runs_on_the_reference() -> None:
    """transformers 5.x imports `torch_npu.npu_fusion_attention` as soon as torch_npu imports (every
    model import goes through it: activations -> flash_attention -> npu_flash_attention); its
    flash-attention functions then call it with BSND tensors and the compressed causal mask, or TND
    with cumulative lengths."""
    script = textwrap.dedent(
        """
        import torch, torch_npu
        import torch.nn.functional as F
        from transformers import DeepseekV4ForCausalLM  # noqa: F401  (the import that needs the op)
        from transformers.integrations import npu_flash_attention as fa

        sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(
            q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=causal
        ).transpose(-3, -2)
        q, k, v = (torch.randn(2, 5, 4, 16) for _ in range(3))
        for causal in (False, True):
            got = fa.npu_flash_attn_func(q.npu(), k.npu(), v.npu(), causal=causal)
            torch.testing.assert_close(got.cpu(), sdpa(q, k, v, causal))
        q, k, v = (torch.randn(8, 4, 16) for _ in range(3))
        cu = torch.tensor([0, 3, 8]).npu()
        got = fa.npu_flash_attn_varlen_func(q.npu(), k.npu(), v.npu(), cu, cu, causal=True)
        want = torch.cat([sdpa(q[a:b], k[a:b], v[a:b], True) for a, b in ((0, 3), (3, 8))])
        torch.testing.assert_close(got.cpu(), want)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
