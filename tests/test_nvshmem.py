"""The NVSHMEM engine on the CPU: the ABI of the structs meld hands NVSHMEM's host library, the library's
unique-id bootstrap arguments filled where meld reads them (where the library is installed), the proxy's
config struct as both sides see it, and clear errors for a bad engine or a missing library. Its runs on GPUs
are in test_dist_gpu.py (test_the_operators_on_the_nvshmem_engine_match_float64)."""
import ctypes

import pytest

from meld.distributed import nvshmem
from meld.distributed.window import SymmetricWindow


def test_the_init_structs_have_nvshmem_v1_layout():
    sizes = {nvshmem.UniqueId: 128, nvshmem.UniqueIdArgs: 24, nvshmem.InitArgs: 128, nvshmem.InitAttr: 144}
    assert {s: ctypes.sizeof(s) for s in sizes} == sizes
    assert nvshmem.InitArgs.uid_args.offset == 8 and nvshmem.InitAttr.args.offset == 16
    assert nvshmem.UniqueIdArgs.id.offset == 8 and nvshmem.UniqueIdArgs.nranks.offset == 20


def _library_or_skip():
    try:
        return nvshmem.library()
    except RuntimeError as e:
        pytest.skip(f"NVSHMEM's host library is not installed here: {e}"[:300])


def test_the_library_fills_the_unique_id_arguments_where_meld_reads_them():
    lib = _library_or_skip()
    uid = nvshmem.UniqueId(version=(1 << 16) + 128)
    assert lib.nvshmemx_get_uniqueid(ctypes.byref(uid)) == 0
    attr = nvshmem.InitAttr(version=(1 << 16) + 144)
    attr.args.version = (1 << 16) + 128
    attr.args.uid_args = nvshmem.UniqueIdArgs((1 << 16) + 24, None, -1, -1)
    assert lib.nvshmemx_set_attr_uniqueid_args(1, 3, ctypes.byref(uid), ctypes.byref(attr)) == 0
    got = attr.args.uid_args
    assert (got.myrank, got.nranks) == (1, 3)
    assert ctypes.addressof(got.id.contents) == ctypes.addressof(uid)


def test_a_failed_start_is_a_status_not_a_crash():
    """Without a GPU, NVSHMEM's start fails: with a status meld turns into a RuntimeError, not an exit of the
    process (the inline nvshmemx_init_attr would exit; meld calls nvshmemx_hostlib_init_attr). In a child
    process: a started or half-started job is not this test process's."""
    import os
    import subprocess
    import sys

    import torch

    _library_or_skip()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the start would not fail")
    code = ("import ctypes; from meld.distributed import nvshmem as n; lib = n.library(); "
            "u = n.UniqueId(version=(1 << 16) + 128); assert lib.nvshmemx_get_uniqueid(ctypes.byref(u)) == 0; "
            "a = n.InitAttr(version=(1 << 16) + 144); a.args.version = (1 << 16) + 128; "
            "a.args.uid_args = n.UniqueIdArgs((1 << 16) + 24, None, -1, -1); "
            "assert lib.nvshmemx_set_attr_uniqueid_args(0, 1, ctypes.byref(u), ctypes.byref(a)) == 0; "
            "print('status', lib.nvshmemx_hostlib_init_attr(n.INIT_WITH_UNIQUEID, ctypes.byref(a)))")
    env = {**os.environ, "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    status = int(got.stdout.split("status")[-1])
    assert status != 0


def test_a_job_started_by_another_library_is_refused(monkeypatch):
    class Started:
        @staticmethod
        def nvshmemx_init_status():
            return 2

    monkeypatch.setattr(nvshmem, "_job", None)
    monkeypatch.setattr(nvshmem, "library", lambda: Started)
    with pytest.raises(RuntimeError, match="already initialised in this process"):
        nvshmem.job(None, None)


def test_a_missing_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nvshmem, "_library", None)
    monkeypatch.setattr(nvshmem, "_candidates", lambda: ["/nonexistent/libnvshmem_host.so.3"])
    with pytest.raises(RuntimeError, match="engine='nvshmem' needs NVSHMEM's host library.*/nonexistent"):
        nvshmem.library()


def test_the_library_is_looked_for_at_meld_nvshmem_lib_first(monkeypatch):
    monkeypatch.setenv("MELD_NVSHMEM_LIB", "/opt/x/libnvshmem_host.so.3")
    found = nvshmem._candidates()
    assert found[0] == "/opt/x/libnvshmem_host.so.3" and found[-1] == nvshmem.LIBRARY


def test_a_bad_engine_names_the_argument_before_anything_starts():
    from meld.distributed import ExpertParallelMoE, RowParallelLinear, SeqParallelDecode

    with pytest.raises(ValueError, match="engine='nccl'"):
        SymmetricWindow(1024, None, None, engine="nccl")
    with pytest.raises(ValueError, match="engine='ib'"):
        ExpertParallelMoE(256, 128, 8, 2, max_num_tokens=4, engine="ib")
    with pytest.raises(ValueError, match="engine=None"):
        RowParallelLinear(64, 64, max_tokens=8, engine=None)
    with pytest.raises(ValueError, match="engine='x'"):
        SeqParallelDecode(32, 8, 128, 16, max_batch_size=4, max_num_pages=8, engine="x")


def test_the_proxy_config_struct_is_the_same_size_on_both_sides():
    from meld.runtime.host_helper import ProxyConfig, load_proxy

    try:
        lib = load_proxy()   # (raises if the sizes differ)
    except RuntimeError as e:
        if "compiler" in str(e):
            pytest.skip(str(e))
        raise
    assert lib.meld_proxy_config_bytes() == ctypes.sizeof(ProxyConfig)


def test_the_peer_transport_refuses_a_window_it_cannot_reach_and_releases_it(monkeypatch):
    """A window with a rank it cannot load from or store to (ptr 0: another node) cannot carry the peer
    transport: a clear error naming the ranks and the way out, the window released first (collective on NVSHMEM:
    every rank meets the same condition)."""
    from meld.distributed import member

    closed = []

    class Window:
        def __init__(self, nbytes, device, group, engine):
            self.ptrs, self.engine = [4096, 0], engine

        every_rank_mapped = property(lambda self: all(self.ptrs))

        def close(self):
            closed.append(True)

    class Op(member.GroupMember):
        rank = 0
        group = None

    monkeypatch.setattr(member, "SymmetricWindow", Window)
    with pytest.raises(ValueError, match=r"ranks \[1\] cannot be reached.*engine='nvshmem'.*transport='proxy'"):
        Op()._open_window(1024, None, "peer", True, 1 << 16, "nvshmem")
    assert closed == [True]
