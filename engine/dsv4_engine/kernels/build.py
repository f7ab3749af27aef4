"""Building and loading the fused CPU kernels (`cpu.cpp`, `attention.cpp`, `pages.cpp`), once a process.

They are built with torch's C++ extension tooling on first use into `$XDG_CACHE_HOME/dsv4/kernels/<hash>`
(the hash covers the sources, torch's version and location, and the compiler flags), so a second process only loads
the shared library. Each op is registered as `torch.ops.dsv4.*` with a fake (meta) implementation, so
`torch.compile` keeps it as one opaque call; eager code calls the same functions bound directly
(`module()`, `bindings.cpp`), skipping the dispatcher. With `DSV4_KERNELS=0`, or when no C++ compiler is
present, `available()` is False and nothing is built: `kernels.choose_kernels` then never picks the CPU
set (`kernels/cpu.py`).

An image without a compiler ships them prebuilt: `python -m dsv4_engine.kernels --prebuilt-dir DIR`
builds and copies the library to `DIR/<key>/`, and a process with `DSV4_KERNELS_PREBUILT=DIR` whose key
(the same hash) is there imports it as it is, writing nothing (the image's files are read-only and
owned by another user).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# bindings.cpp includes the other three: one translation unit, the ops and their direct bindings.
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("bindings.cpp", "cpu.cpp", "attention.cpp", "pages.cpp")
)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("rows.h", "simd.h"))
# No -fopenmp: ATen's OpenMP `parallel_for` is inline and parallel only when its caller is compiled with
# OpenMP, so the kernels' parallel_for loops run serially on the calling thread. Measured with it on (2
# cores, demo model): decode steps no faster at 1.6x the CPU, prefill steps the same; the big products
# inside the kernels are BLAS calls, which have MKL's threads either way.
CFLAGS = ("-O3",)
NAME = "dsv4_cpu_kernels"  # the extension module, and its library's name in the cache folder
KERNELS_ENV = "DSV4_KERNELS"  # "0": never build or use them (also the default of EngineConfig.kernels)
PREBUILT_ENV = "DSV4_KERNELS_PREBUILT"  # a folder of prebuilt libraries, one subfolder per key
_built: dict[str, bool] = {}  # "ok": whether the kernels loaded (decided once a process)
_bound: list[Any] = []  # the built module (its direct bindings), once loaded


def _key() -> str:
    """The sources, torch's version and location, and the flags. The location too: the build file
    names torch's headers by path, so two environments (two venvs) sharing one folder would each
    rebuild the other's library on every start (37 s here), silently."""
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    where = str(Path(torch.__file__).resolve().parent)
    key = hashlib.sha256(sources + torch.__version__.encode() + where.encode() + " ".join(CFLAGS).encode())
    return key.hexdigest()[:16]


def cache_dir() -> Path:
    """Where this process builds: `$XDG_CACHE_HOME/dsv4/kernels/<key>`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dsv4" / "kernels" / _key()


def _prebuilt() -> Path | None:
    """The library `DSV4_KERNELS_PREBUILT` holds for this key, if any."""
    folder = os.environ.get(PREBUILT_ENV)
    lib = Path(folder) / _key() / f"{NAME}.so" if folder else None
    return lib if lib is not None and lib.is_file() else None


def _import(lib: Path) -> Any:
    spec = importlib.util.spec_from_file_location(NAME, lib)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers torch.ops.dsv4.*
    return module


def _build() -> None:
    lib = _prebuilt()
    if lib is not None:
        log.info("fused CPU kernels: prebuilt, from %s", lib)
        module = _import(lib)
    else:
        out = cache_dir()
        out.mkdir(parents=True, exist_ok=True)
        module = _load_built(out) or _compile(out)
    _register_fakes()
    _bound[:] = [module]


@contextlib.contextmanager
def _build_lock(out: Path, mode: int) -> Iterator[None]:
    """The folder's build lock: shared to read its library, exclusive to build it. The kernel drops
    it when its holder dies, so a build killed midway never holds up the next start."""
    with open(out / "build.flock", "a") as held:
        try:
            fcntl.flock(held, mode | fcntl.LOCK_NB)
        except BlockingIOError:  # said, so a silent start has a reason in the log
            log.info("fused CPU kernels: waiting for another process's build in %s", out)
            fcntl.flock(held, mode)
        yield


def _import_built(lib: Path) -> Any | None:
    """The library at `lib`, imported as it is; None when there is none, or it does not load (a build
    killed while linking: it is built again)."""
    if not lib.is_file():
        return None
    try:
        return _import(lib)
    except ImportError as exc:
        log.warning("fused CPU kernels: %s does not load (%s); building it again", lib, exc)
        return None


def _load_built(out: Path) -> Any | None:
    """The library this folder's key built before, imported as it is; None when there is none yet.
    The folder is named by the hash of the sources, torch and the flags, so a library in it is
    current. Asking torch's builder instead has ninja compare the compile command, which names the
    folder's path: a folder seen under two paths (a pod mounting the host's cache) was rebuilt at
    every other start, each build undoing the other (CI: ten rebuilds of 33-254 s in one run). The
    shared lock keeps it from reading a library another process is still writing."""
    with _build_lock(out, fcntl.LOCK_SH):
        return _import_built(out / f"{NAME}.so")


def _compile(out: Path) -> Any:
    from torch.utils import cpp_extension

    # pip's ninja (a dependency) sits beside this interpreter: every process uses it, first on PATH.
    # Two ninja versions hash the compile command differently, so a process finding Debian's 1.11 and
    # one finding pip's 1.13 each rebuilt what the other built (35 s a start, seen in .ninja_log).
    here = Path(sys.executable).parent
    if (here / "ninja").exists() or shutil.which("ninja") is None:
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
    # One build at a time. torch's own lock is a file it waits on while it exists: a build killed
    # midway (a pod stopped during start-up) leaves it behind, and every later build would wait
    # forever. Under our exclusive lock nobody else is building, so a torch lock found here is such a
    # leftover.
    with _build_lock(out, fcntl.LOCK_EX):
        (out / "lock").unlink(missing_ok=True)
        module = _import_built(out / f"{NAME}.so")  # built by the process this one waited for
        if module is not None:
            return module
        log.info("fused CPU kernels: building into %s (a minute or more; once per version)", out)
        return cpp_extension.load(
            name=NAME,
            sources=[str(_staged_sources(out))],
            build_directory=str(out),
            extra_cflags=list(CFLAGS),
            is_python_module=True,
            verbose=False,
        )


def _staged_sources(out: Path) -> Path:
    """The sources, copied into the cache folder once: the build file names its sources by path, so
    two installs of the same sources (two checkouts, a venv and a checkout) building from their own
    paths would each rebuild the other's library in the shared folder; from one copy they share it.
    Written only when the content differs (a rewrite would look newer to the build)."""
    src = out / "src"
    src.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        data, dst = path.read_bytes(), src / path.name
        if not dst.is_file() or dst.read_bytes() != data:
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return src / SOURCES[0].name


def _register_fakes() -> None:
    @torch.library.register_fake("dsv4::hc_pre")
    def _(streams, fn, base, scale, iters, hc_eps, norm_eps):  # type: ignore[no-untyped-def]
        t, n = streams.shape[0], streams.shape[1]
        f32 = torch.float32
        post = streams.new_empty(t, n, dtype=f32)
        comb = streams.new_empty(t, n, n, dtype=f32)
        return post, comb, streams.new_empty(t, streams.shape[2])

    @torch.library.register_fake("dsv4::fill_decode")
    def _(
        req,
        pos,
        valid,
        swa,
        tokens,
        c4s,
        c128s,
        page_size,
        swa_loc,
        c4_loc,
        c4s_loc,
        c128_loc,
        c128s_loc,
        main,
        c4,
        c128,
    ):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("dsv4::sink_attention")
    def _(q, keys, bias, sinks, scaling):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape[0], q.shape[1], keys.shape[2], dtype=keys.dtype)

    @torch.library.register_fake("dsv4::rms_norm")
    def _(x, weight, eps):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)

    @torch.library.register_fake("dsv4::rope_rotate")
    def _(x, cos, sin, inverse):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)

    @torch.library.register_fake("dsv4::moe_experts")
    def _(x, gate_up, down, ids, weights, limit):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)

    @torch.library.register_fake("dsv4::hc_post")
    def _(post, comb, out, streams):  # type: ignore[no-untyped-def]
        return torch.empty_like(streams)

    @torch.library.register_fake("dsv4::masked_put")
    def _(pool, slots, rows, mask):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("dsv4::route")
    def _(x, input_ids, weight, table, is_hash, top_k, scaling):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], top_k), x.new_empty(x.shape[0], top_k, dtype=torch.long)

    @torch.library.register_fake("dsv4::compress_decode")
    def _(kv, gate, pb, pos, wmask, wloc, start, slots, bmask, bloc, bpos, cos, sin, w, eps, state, rows):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("dsv4::index_topk")
    def _(q, weights, keys, page_table, visible, ratio, page_size, scale, k):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape[0], k, dtype=torch.long)

    @torch.library.register_fake("dsv4::topk_bias")
    def _(scores, visible, k):  # type: ignore[no-untyped-def]
        return torch.empty_like(scores)

    @torch.library.register_fake("dsv4::block_attention")
    def _(q, keys, bias, sinks, scaling):  # type: ignore[no-untyped-def]
        return q.new_empty(q.shape[0] * q.shape[1], q.shape[2], q.shape[3])

    @torch.library.register_fake("dsv4::gather_pages")
    def _(buffers, pages, staged):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("dsv4::scatter_pages")
    def _(buffers, pages, staged):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("dsv4::paged_attention")
    def _(q, swa, swa_slots, comp, page_table, rows, visible, ratio, page_size, sinks, scaling):  # type: ignore[no-untyped-def]
        return torch.empty_like(q)

    @torch.library.register_fake("dsv4::linear")
    def _(x, weight):  # type: ignore[no-untyped-def]
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("dsv4::grouped_linear")
    def _(x, weight):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("dsv4::shared_expert")
    def _(x, gate_up, down, limit):  # type: ignore[no-untyped-def]
        return x.new_empty(x.shape[0], down.shape[0])


def available() -> bool:
    """True once the kernels are loaded; builds them on the first call (a minute, then cached)."""
    if "ok" not in _built:
        if os.environ.get(KERNELS_ENV, "1") == "0":
            _built["ok"] = False
        else:
            try:
                _build()
                _built["ok"] = True
            except Exception as exc:  # no compiler, no headers: the torch code still runs
                log.warning("fused CPU kernels unavailable, using torch ops: %s", exc)
                _built["ok"] = False
    return _built["ok"]


def module() -> Any:
    """The built module: the per-layer kernels bound directly (`bindings.cpp`: `module().rms_norm(x,
    weight, eps)`, the arguments of `torch.ops.dsv4.rms_norm`), for eager calls, ~1 us a call less
    than through the dispatcher. Only after `available()` returned True."""
    return _bound[0]


def main(argv: list[str] | None = None) -> int:
    """`python -m dsv4_engine.kernels`: build the kernels ahead of any server (the test command
    and images do, so no start waits on a build); prints where they are. Exit 1 where they cannot be
    built (the torch forms still run, slower)."""
    parser = argparse.ArgumentParser(prog="python -m dsv4_engine.kernels", description=main.__doc__)
    parser.add_argument(
        "--prebuilt-dir",
        type=Path,
        help=f"also copy the library to DIR/<key>/, for processes run with {PREBUILT_ENV}=DIR (an image "
        "without a compiler)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not available():
        return 1
    if args.prebuilt_dir is None:
        print(cache_dir())
        return 0
    dst = args.prebuilt_dir / _key()
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(module().__file__, dst / f"{NAME}.so")
    print(dst)
    return 0
