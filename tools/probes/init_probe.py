"""Does compute-sanitizer's initcheck count a cuBLAS GEMM's output as initialised? A plain torch kernel reads
one (on the H200, with torch 2.11: it reports every element as an uninitialised read; tools/SANITIZE.md).

    compute-sanitizer --tool initcheck --show-backtrace no python3 tools/probes/init_probe.py
"""
import torch

x = torch.randn(3, 128, dtype=torch.bfloat16, device="cuda")
proj = torch.nn.Linear(128, 8 * 128, bias=False, dtype=torch.bfloat16, device="cuda")   # as test_torch_ops' q_proj
with torch.no_grad():
    y = proj(x)
    torch.cuda.synchronize()
    print("reading the GEMM's output", flush=True)
    print("sum", y.float().sum().item(), flush=True)
