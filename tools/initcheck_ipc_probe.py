"""Does compute-sanitizer's initcheck follow memory that another process initialised and shared through
CUDA IPC? Run `compute-sanitizer --tool initcheck python tools/initcheck_ipc_probe.py` (tools/SANITIZE.md,
2026-12-02): the parent zeroes a tensor and shares it (torch's CUDA IPC); the child reads it with `add_`, and
reads a tensor it zeroed itself as the control. The child prints both addresses, to match the reports'."""
import torch
import torch.multiprocessing as mp


def child(shared: torch.Tensor, done: mp.Queue) -> None:
    own = torch.zeros(1024, device="cuda")
    print(f"child: shared tensor at {shared.data_ptr():#x}, own tensor at {own.data_ptr():#x}", flush=True)
    own.add_(1)      # initialised in this process
    shared.add_(1)   # initialised by the parent only
    torch.cuda.synchronize()
    done.put(float(shared.sum() + own.sum()))


if __name__ == "__main__":
    mp.set_start_method("spawn")
    shared = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    done = mp.Queue()
    proc = mp.Process(target=child, args=(shared, done))
    proc.start()
    print("sum", done.get())
    proc.join()
