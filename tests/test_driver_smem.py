"""The dynamic shared memory a loaded kernel allows (meld/runtime/driver.py): a CUfunction is shared by every
Kernel of one module and entry, so the limit a later Kernel sets must never fall below an earlier one's (it
did: two decode operators of different grids shared the GPU planner, and the first's plan() launch failed with
invalid argument after the second was built; FlashInfer's single decode tests at head_dim 64, full matrix)."""
import pytest
import torch

from meld.runtime import driver


class _FakeDriver:
    """The one driver call _allow_smem makes, recorded."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self):
        self.limit: dict[object, int] = {}

    def cuFuncSetAttribute(self, func, attr, value):
        self.limit[func] = value
        return (0,)


def test_the_limit_only_rises(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(driver, "drv", lambda: fake)
    monkeypatch.setattr(driver, "check", lambda res, what: None)
    monkeypatch.setattr(driver, "_smem_allowed", {})
    for smem in (40_000, 9_000, 70_000, 100):
        driver._allow_smem("f", ("module", "entry"), smem, "k")
    assert fake.limit["f"] == 70_000
    driver._allow_smem("g", ("module", "other entry"), 100, "k")   # another entry: its own limit
    assert fake.limit["g"] == 100


@pytest.mark.gpu
def test_a_smaller_kernel_keeps_the_larger_limit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from meld.codegen import DecodePlanKernelConfig, compile_source

    cfg, dev = DecodePlanKernelConfig(), torch.device("cuda")
    compiled = compile_source(cfg.render(), cfg.name)
    big, small = cfg.smem_bytes(4000), cfg.smem_bytes(132)
    first = driver.Kernel(compiled, cfg.entry, dev, cfg.threads, big)
    driver.Kernel(compiled, cfg.entry, dev, cfg.threads, small)
    attr = driver.drv().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert driver.check(driver.drv().cuFuncGetAttribute(attr, first.func), "get smem") >= big
