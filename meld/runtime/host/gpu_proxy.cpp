// meld's GPU proxy (meld/distributed/proxy.py): the host thread that lands the puts and signals a kernel writes into
// its command ring, the model of an RDMA NIC's proxy on the GPUs of one node.
//
// Written in C++ and holding no Python lock, because its progress must not depend on the Python thread that
// launched the kernel: that thread may block in a call that holds the GIL while it waits for the GPU (a
// first cuBLAS call loading its module, an allocation that frees cached memory), and a kernel that waits
// for the proxy would then never finish. The CUDA driver is reached through dlopen (no CUDA headers are
// needed to build this file with the system compiler).
//
// Two engines land the operations. Copies (engine 0, the model on one node): a put is a driver copy from this
// rank's window into the destination's mapped one, a signal a stream memory write there. NVSHMEM (engine 1,
// meld/distributed/nvshmem.py; the windows are on its symmetric heap): a put is nvshmemx_putmem_on_stream to the
// same offset of the destination's window, a signal nvshmemx_quiet_on_stream (every put before it has landed)
// then nvshmemx_signal_op_on_stream setting the running total, which NVSHMEM carries over NVLink within a node
// and over its network transport between nodes. Its functions are found among the process's global symbols
// (Python loaded the library with RTLD_GLOBAL before the thread starts).
//
// Delivery follows transport.ProxySchedule's rules (the CPU emulation's; tests/test_gpu_proxy_plan.py
// compares them): one channel per destination in issue order, every put cut into network chunks of
// `chunk` bytes, and either `ordered` (every operation in issue order on one stream) or unordered (each
// batch shuffled, puts on two copy streams at random; a signal only once it is its channel's oldest
// operation, and after both streams' earlier work: one fence per destination). A signal adds to a running
// total per (destination, slot), which is written into the destination with a stream memory write.

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

struct Command {   // transport.COMMAND: 48 bytes
  uint32_t op, window, dst, pad;
  uint64_t start, count;
  int64_t addend;
  uint64_t ticket;
};
static_assert(sizeof(Command) == 48, "transport.COMMAND is 48 bytes");
constexpr uint32_t PUT = 1, SIGNAL = 3;

struct Op {   // one operation as issued; also meld_proxy_plan's output record
  int32_t kind, dst, stream, pad;   // stream: the copy stream of a put (0 or 1); a signal runs on stream 0
  uint64_t start, count;            // bytes in the destination's window (a signal: its slot, count 0)
  int64_t value;                    // a signal's running total
};

// The channels of one proxy and the rules of what may be issued next.
class Schedule {
 public:
  Schedule(bool ordered, uint64_t chunk, uint64_t seed) : ordered_(ordered), chunk_(chunk), rng_(seed) {}

  // A record into operations; an empty string, or what is wrong with it.
  std::string add(const Command& c, int world, uint64_t window_bytes) {
    if (c.dst >= (uint32_t)world) return "a record for rank " + std::to_string(c.dst) + " of " + std::to_string(world);
    if (c.op == PUT) {
      if (c.start > window_bytes || c.count > window_bytes - c.start)
        return "a put of bytes [" + std::to_string(c.start) + ", " + std::to_string(c.start + c.count) +
               ") outside the window of " + std::to_string(window_bytes) + " bytes";
      for (uint64_t a = 0; a < c.count; a += chunk_)
        channel(c.dst).push_back(Op{(int32_t)PUT, (int32_t)c.dst, 0, 0, c.start + a, std::min(chunk_, c.count - a), 0});
      return "";
    }
    if (c.op != SIGNAL) return "a record of op " + std::to_string(c.op) + " (the GPU proxy lands puts and signals)";
    if (c.start % 8 || c.start + 8 > window_bytes) return "a signal slot at byte " + std::to_string(c.start);
    const int64_t total = totals_[{c.dst, c.start}] += c.addend;
    channel(c.dst).push_back(Op{(int32_t)SIGNAL, (int32_t)c.dst, 0, 0, c.start, 0, total});
    return "";
  }

  // What to issue now, in order (removed from the channels): everything (ordered); or every put and each
  // channel's oldest operation if it is a signal, shuffled, puts given a stream at random (unordered).
  void next(std::vector<Op>& out) {
    out.clear();
    for (auto& ch : channels_) {
      if (ordered_) {
        out.insert(out.end(), ch.begin(), ch.end());
        ch.clear();
        continue;
      }
      std::deque<Op> kept;
      for (size_t i = 0; i < ch.size(); ++i)
        if (ch[i].kind == (int32_t)PUT || i == 0)
          out.push_back(ch[i]);
        else
          kept.push_back(ch[i]);
      ch.swap(kept);
    }
    if (ordered_) return;
    std::shuffle(out.begin(), out.end(), rng_);
    for (auto& op : out) op.stream = op.kind == (int32_t)PUT ? (int32_t)(rng_() & 1) : 0;
  }

 private:
  std::deque<Op>& channel(uint32_t dst) {
    if (channels_.size() <= dst) channels_.resize(dst + 1);
    return channels_[dst];
  }
  bool ordered_;
  uint64_t chunk_;
  std::mt19937_64 rng_;
  std::vector<std::deque<Op>> channels_;
  std::map<std::pair<uint32_t, uint64_t>, int64_t> totals_;
};

// The CUDA driver functions the proxy uses (driver API, resolved with dlsym: the _v2 name where there is one).
using CUresult = int;
using CUstream = void*;
using CUevent = void*;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
struct Driver {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(int*, int);
  CUresult (*primary_retain)(CUcontext*, int);
  CUresult (*primary_release)(int);
  CUresult (*ctx_set)(CUcontext);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_sync)(CUstream);
  CUresult (*event_create)(CUevent*, unsigned);
  CUresult (*event_destroy)(CUevent);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned);
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*write_value64)(CUstream, CUdeviceptr, uint64_t, unsigned);
  CUresult (*error_string)(CUresult, const char**);
};

template <class F>
bool resolve(void* lib, const char* name, F& f) {
  void* p = dlsym(lib, (std::string(name) + "_v2").c_str());
  if (!p) p = dlsym(lib, name);
  f = reinterpret_cast<F>(p);
  return p != nullptr;
}

std::string load_driver(Driver& d) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return std::string("dlopen libcuda.so.1: ") + dlerror();
  const bool ok = resolve(lib, "cuInit", d.init) && resolve(lib, "cuDeviceGet", d.device_get) &&
                  resolve(lib, "cuDevicePrimaryCtxRetain", d.primary_retain) &&
                  resolve(lib, "cuDevicePrimaryCtxRelease", d.primary_release) && resolve(lib, "cuCtxSetCurrent", d.ctx_set) &&
                  resolve(lib, "cuStreamCreate", d.stream_create) && resolve(lib, "cuStreamDestroy", d.stream_destroy) &&
                  resolve(lib, "cuStreamSynchronize", d.stream_sync) && resolve(lib, "cuEventCreate", d.event_create) &&
                  resolve(lib, "cuEventDestroy", d.event_destroy) && resolve(lib, "cuEventRecord", d.event_record) &&
                  resolve(lib, "cuStreamWaitEvent", d.stream_wait_event) && resolve(lib, "cuMemcpyAsync", d.memcpy_async) &&
                  resolve(lib, "cuStreamWriteValue64", d.write_value64) && resolve(lib, "cuGetErrorString", d.error_string);
  return ok ? "" : "libcuda.so.1 lacks a driver function the proxy needs";
}

// NVSHMEM's stream operations (host library, resolved among the global symbols; cudaStream_t is a CUstream).
struct Nvshmem {
  void (*put)(void* dest, const void* source, size_t bytes, int pe, CUstream stream);
  void (*quiet)(CUstream stream);
  void (*signal)(uint64_t* sig_addr, uint64_t signal, int sig_op, int pe, CUstream stream);
};
constexpr int NVSHMEM_SIGNAL_SET = 9;

std::string load_nvshmem(Nvshmem& n) {
  n.put = reinterpret_cast<decltype(n.put)>(dlsym(RTLD_DEFAULT, "nvshmemx_putmem_on_stream"));
  n.quiet = reinterpret_cast<decltype(n.quiet)>(dlsym(RTLD_DEFAULT, "nvshmemx_quiet_on_stream"));
  n.signal = reinterpret_cast<decltype(n.signal)>(dlsym(RTLD_DEFAULT, "nvshmemx_signal_op_on_stream"));
  return n.put && n.quiet && n.signal ? "" : "NVSHMEM's host library is not loaded (meld.distributed.nvshmem loads it)";
}

}  // namespace

extern "C" {

struct MeldProxyConfig {
  Command* records;                 // the ring (pinned host memory the kernel writes)
  volatile long long* head;         // records taken (pinned; the kernel reads it)
  long long capacity;
  const unsigned long long* peers;  // every rank's window base, as this rank addresses it
  unsigned long long window_bytes;
  unsigned long long chunk, seed;
  long long poll_ns;                // idle: sleep this long between polls (after a short spin)
  int world, rank, ordered, device;
  int engine;                       // 0: driver copies between mapped windows; 1: NVSHMEM (header)
};

struct MeldProxy {
  MeldProxyConfig cfg;
  std::vector<unsigned long long> peers;
  Driver d{};
  Nvshmem nv{};
  int dev = 0;
  CUcontext ctx = nullptr;
  CUstream streams[2] = {nullptr, nullptr};
  CUevent fence = nullptr;
  Schedule schedule;
  std::thread thread;
  std::atomic<bool> stop{false}, failed{false};
  std::atomic<long long> landed{0};
  std::string error;

  MeldProxy(const MeldProxyConfig& c)
      : cfg(c), peers(c.peers, c.peers + c.world), schedule(c.ordered != 0, c.chunk, c.seed) {}

  bool check(CUresult r, const char* what) {
    if (r == 0) return true;
    const char* s = nullptr;
    d.error_string(r, &s);
    error = std::string(what) + " failed: CUDA error " + std::to_string(r) + " (" + (s ? s : "?") + ")";
    return false;
  }

  std::string setup() {
    std::string e = load_driver(d);
    if (!e.empty()) return e;
    if (!check(d.init(0), "cuInit") || !check(d.device_get(&dev, cfg.device), "cuDeviceGet") ||
        !check(d.primary_retain(&ctx, dev), "cuDevicePrimaryCtxRetain") || !check(d.ctx_set(ctx), "cuCtxSetCurrent") ||
        !check(d.stream_create(&streams[0], 1), "cuStreamCreate") || !check(d.stream_create(&streams[1], 1), "cuStreamCreate") ||
        !check(d.event_create(&fence, 2), "cuEventCreate"))
      return error;
    return cfg.engine == 1 ? load_nvshmem(nv) : "";
  }

  bool issue(const Op& op) {
    const CUdeviceptr dst = peers[op.dst] + op.start, mine = peers[cfg.rank] + op.start;
    if (op.kind == (int32_t)PUT) {
      if (cfg.engine != 1)
        return check(d.memcpy_async(dst, mine, op.count, streams[op.stream]), "cuMemcpyAsync (put)");
      nv.put(reinterpret_cast<void*>(mine), reinterpret_cast<const void*>(mine), op.count, op.dst, streams[op.stream]);
      return true;
    }
    if (!cfg.ordered &&   // every put issued before it, on either stream, lands first
        !(check(d.event_record(fence, streams[1]), "cuEventRecord") &&
          check(d.stream_wait_event(streams[0], fence, 0), "cuStreamWaitEvent")))
      return false;
    if (cfg.engine != 1)
      return check(d.write_value64(streams[0], dst, (uint64_t)op.value, 0), "cuStreamWriteValue64 (signal)");
    nv.quiet(streams[0]);   // NVSHMEM orders nothing between separate puts and a signal: they complete first
    nv.signal(reinterpret_cast<uint64_t*>(mine), (uint64_t)op.value, NVSHMEM_SIGNAL_SET, op.dst, streams[0]);
    return true;
  }

  void run() {
    if (!check(d.ctx_set(ctx), "cuCtxSetCurrent")) return fail();
    long long head = 0;
    int idle = 0;
    std::vector<Op> batch;
    while (!stop.load(std::memory_order_relaxed)) {
      bool took = false;
      for (;; ++head, took = true) {
        const Command* rec = cfg.records + head % cfg.capacity;
        if (*reinterpret_cast<const volatile uint64_t*>(&rec->ticket) != (uint64_t)head + 1) break;
        std::atomic_thread_fence(std::memory_order_acquire);   // the fields after their ticket
        Command c;
        std::memcpy(&c, rec, sizeof c);
        const std::string e = schedule.add(c, cfg.world, cfg.window_bytes);
        if (!e.empty()) {
          error = "rank " + std::to_string(cfg.rank) + "'s kernel wrote " + e;
          return fail();
        }
      }
      if (took) {
        std::atomic_thread_fence(std::memory_order_release);
        *cfg.head = head;   // the slots are free for the kernel again
      }
      schedule.next(batch);
      if (batch.empty()) {
        if (++idle > 2000) std::this_thread::sleep_for(std::chrono::nanoseconds(cfg.poll_ns));
        continue;
      }
      idle = 0;
      for (const Op& op : batch)
        if (!issue(op)) return fail();
      landed.fetch_add((long long)batch.size(), std::memory_order_relaxed);
    }
  }

  void fail() { failed.store(true); }
};


// Start a proxy thread; nullptr (and the reason in err[0 .. err_len)) where the driver cannot be set up.
MeldProxy* meld_proxy_start(const MeldProxyConfig* cfg, char* err, int err_len) {
  auto* p = new MeldProxy(*cfg);
  const std::string e = p->setup();
  if (!e.empty()) {
    std::snprintf(err, (size_t)err_len, "%s", e.c_str());
    delete p;
    return nullptr;
  }
  p->thread = std::thread([p] { p->run(); });
  return p;
}

// sizeof(MeldProxyConfig), which host_helper.ProxyConfig must match.
long long meld_proxy_config_bytes() { return (long long)sizeof(MeldProxyConfig); }

// What stopped the thread ("" while it runs), and the operations it issued.
const char* meld_proxy_error(MeldProxy* p) { return p->failed.load() ? p->error.c_str() : ""; }
long long meld_proxy_landed(MeldProxy* p) { return p->landed.load(); }

// Stop the thread, wait for what it issued, release its streams.
void meld_proxy_stop(MeldProxy* p) {
  p->stop.store(true);
  p->thread.join();
  for (CUstream s : p->streams) {
    p->d.stream_sync(s);
    p->d.stream_destroy(s);
  }
  p->d.event_destroy(p->fence);
  p->d.primary_release(p->dev);
  delete p;
}

// The schedule alone (no CUDA): the operations n records become, in the order the proxy issues them, batch
// after batch until none is left; returns how many (at most cap are written), or -1 with a bad record.
long long meld_proxy_plan(const Command* records, long long n, int world, unsigned long long window_bytes, int ordered,
                          unsigned long long chunk, unsigned long long seed, Op* out, long long cap) {
  Schedule s(ordered != 0, chunk, seed);
  for (long long i = 0; i < n; ++i)
    if (!s.add(records[i], world, window_bytes).empty()) return -1;
  long long made = 0;
  std::vector<Op> batch;
  for (s.next(batch); !batch.empty(); s.next(batch))
    for (const Op& op : batch) {
      if (made < cap) out[made] = op;
      ++made;
    }
  return made;
}

}  // extern "C"
