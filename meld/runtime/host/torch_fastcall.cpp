// The C++ fast path of meld's torch ops (meld/runtime/torch_fastcall.py): a boxed kernel that replays the launches
// Python recorded for an operator (its handle) when the call's arguments match what they were recorded for, without
// calling into Python; anything else goes to the op's Python kernel (its "slow" twin op), which checks everything,
// launches and records again. Built against torch's headers, loaded with ctypes; driven through the C functions at
// the end. No CUDA header: cuLaunchKernelEx comes as a function pointer (libcuda's, or a test's stand-in).
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct LaunchAttr {   // CUlaunchAttribute
  int id;
  int pad;
  unsigned value[16];
};
struct LaunchConfig {   // CUlaunchConfig
  unsigned grid[3];
  unsigned block[3];
  unsigned smem;
  void* stream;
  LaunchAttr* attrs;
  unsigned num_attrs;
};
using LaunchFn = int (*)(const LaunchConfig*, void*, void**, void**);

enum Kind : int64_t { kNone = 0, kTensor = 1, kDouble = 2, kAny = 3 };

struct Arg {   // what a call's argument must be for the record to apply
  int64_t kind = kAny;
  int64_t dtype = 0, device_type = 0, device_index = 0;
  int64_t pinned = 0, pinned_ptr = 0;   // the exact address (a pointer also baked into a tensor map)
  int64_t written = 0;                  // an output: may not overlap any other tensor argument
  std::vector<int64_t> sizes, strides;
  double value = 0;
};
struct Patch {   // launch `launch`'s parameter bytes at `offset` = argument `arg`'s address + `addend`
  int64_t launch, offset, arg, addend;
};
struct Launch {
  void* func;
  LaunchConfig config;
  std::vector<LaunchAttr> attrs;
  std::vector<unsigned char> blob;
  void* argv[1];
};
struct Record {
  int64_t op = -1;   // the op that recorded it (a handle names an operator, not an op: another op's call never matches)
  std::vector<Arg> args;
  std::vector<Patch> patches;
  std::vector<Launch> launches;
  int64_t device_type = 0, device_index = 0;
  const volatile int32_t* watchdog = nullptr;   // nonzero once a kernel gave up: the slow path raises
};

// An operator's records. One operator often serves every layer of a model, each with its own tensors: records are
// kept per address of the first argument whose address they require (`pinned`: a tensor map holds it; 0 where
// none is), a few per address, most recent first, so that the layers' calls each find theirs.
constexpr size_t kPerAddress = 4, kAddresses = 1024;
struct Handle {
  int64_t pin_arg = -1;   // the argument whose address keys `by_pin` (-1: none)
  std::unordered_map<uintptr_t, std::vector<std::unique_ptr<Record>>> by_pin;
};

std::mutex mu;
std::unordered_map<int64_t, Handle> handles;
std::atomic<LaunchFn> launch_fn{nullptr};
std::atomic<int64_t> hits{0};
std::vector<std::unique_ptr<torch::Library>> libraries;
std::string last_error;

bool same_double(double a, double b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

// Whether two records apply to the same calls.
bool same_signature(const Record& a, const Record& b) {
  if (a.op != b.op || a.args.size() != b.args.size()) return false;
  for (size_t i = 0; i < a.args.size(); ++i) {
    const Arg &x = a.args[i], &y = b.args[i];
    if (x.kind != y.kind || x.dtype != y.dtype || x.device_type != y.device_type ||
        x.device_index != y.device_index || x.pinned != y.pinned || (x.pinned && x.pinned_ptr != y.pinned_ptr) ||
        x.sizes != y.sizes || x.strides != y.strides || !same_double(x.value, y.value))
      return false;
  }
  return true;
}

// Whether record `r` applies to the call on `args` (the op's arguments), with each tensor argument's bytes,
// [lo, hi), filled in.
// A tensor whose bytes this path may address: not a fake, functional or other Python-dispatched tensor (tracing
// under torch.compile, opcheck's AOT dispatch), which has no data pointer to patch: those take the Python path.
bool addressable(const at::Tensor& t) {
  const c10::DispatchKeySet ks = t.key_set();
  return t.has_storage() && !ks.has(c10::DispatchKey::Python) && !ks.has(c10::DispatchKey::Functionalize) &&
         !t.unsafeGetTensorImpl()->is_python_dispatch();
}

bool matches(const Record& r, const c10::IValue* args, size_t nargs, int64_t op, uintptr_t* lo, uintptr_t* hi) {
  if (r.op != op || r.args.size() != nargs || (r.watchdog != nullptr && *r.watchdog != 0)) return false;
  for (size_t i = 0; i < nargs; ++i) {
    const Arg& a = r.args[i];
    const c10::IValue& v = args[i];
    lo[i] = hi[i] = 0;
    if (a.kind == kNone) {
      if (!v.isNone()) return false;
    } else if (a.kind == kDouble) {
      if (!v.isDouble() || !same_double(v.toDouble(), a.value)) return false;
    } else if (a.kind == kTensor) {
      if (!v.isTensor()) return false;
      const at::Tensor& t = v.toTensor();
      // (an input that requires grad: the Python path ties the outputs to it, at any key)
      if (!addressable(t) || t.layout() != c10::kStrided || t.is_conj() || t.is_neg() || t.requires_grad()) return false;
      if (static_cast<int64_t>(t.scalar_type()) != a.dtype ||
          static_cast<int64_t>(t.device().type()) != a.device_type || t.device().index() != a.device_index ||
          t.dim() != static_cast<int64_t>(a.sizes.size()))
        return false;
      c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
      int64_t span = 1;
      for (size_t d = 0; d < a.sizes.size(); ++d) {
        if (sizes[d] != a.sizes[d] || strides[d] != a.strides[d]) return false;
        if (sizes[d] == 0) span = 0;
        else if (span) span += (sizes[d] - 1) * strides[d];
      }
      uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
      if (a.pinned && p != static_cast<uintptr_t>(a.pinned_ptr)) return false;
      lo[i] = p;
      hi[i] = p + static_cast<uintptr_t>(span) * t.element_size();
    }
  }
  for (size_t w = 0; w < nargs; ++w) {   // an output that overlaps an input: the slow path says so
    if (!r.args[w].written || lo[w] == hi[w]) continue;
    for (size_t j = 0; j < nargs; ++j)
      if (j != w && lo[j] != hi[j] && lo[j] < hi[w] && lo[w] < hi[j]) return false;
  }
  for (const Patch& p : r.patches)   // the kernels read 16-byte chunks: the slow path copies or refuses others
    if ((lo[p.arg] + p.addend) % 16) return false;
  return true;
}

// Launch the record of the call on `args` (the op's arguments); false where none applies.
bool try_launch(const c10::IValue* args, size_t nargs, int64_t handle_arg, int64_t op) {
  LaunchFn fn = launch_fn.load(std::memory_order_relaxed);
  if (fn == nullptr || nargs > 16 || !args[handle_arg].isInt()) return false;
  std::lock_guard<std::mutex> lock(mu);
  auto found = handles.find(args[handle_arg].toInt());
  if (found == handles.end()) return false;
  const Handle& h = found->second;
  uintptr_t key = 0;
  if (h.pin_arg >= 0) {
    if (static_cast<size_t>(h.pin_arg) >= nargs || !args[h.pin_arg].isTensor() ||
        !addressable(args[h.pin_arg].toTensor()))
      return false;
    key = reinterpret_cast<uintptr_t>(args[h.pin_arg].toTensor().data_ptr());
  }
  auto at = h.by_pin.find(key);
  if (at == h.by_pin.end()) return false;
  uintptr_t lo[16], hi[16];   // each tensor argument's bytes, [lo, hi)
  Record* chosen = nullptr;
  for (const auto& candidate : at->second) {
    if (matches(*candidate, args, nargs, op, lo, hi)) {
      chosen = candidate.get();
      break;
    }
  }
  if (chosen == nullptr) return false;
  Record& r = *chosen;
  for (const Patch& p : r.patches) {
    uint64_t value = lo[p.arg] + p.addend;
    std::memcpy(r.launches[p.launch].blob.data() + p.offset, &value, sizeof value);
  }
  void* stream = nullptr;   // a CPU record (a test's stubbed launches) runs on stream 0, as the stub driver's
  if (r.device_type == static_cast<int64_t>(c10::DeviceType::CUDA)) {
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(r.device_index));
    const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    stream = impl->getStreamNativeHandle(impl->getStream(device));   // (torch's current stream: a cudaStream_t)
  }
  for (size_t i = 0; i < r.launches.size(); ++i) {
    Launch& l = r.launches[i];
    l.config.stream = stream;
    int err = fn(&l.config, l.func, l.argv, nullptr);
    if (err != 0) {
      if (i == 0) return false;   // nothing queued: the slow path launches again and reports the error
      TORCH_CHECK(false, "meld fast path: launch ", i, " of ", r.launches.size(), " failed with CUDA error ", err,
                  " after the earlier ones were queued");
    }
  }
  hits.fetch_add(1, std::memory_order_relaxed);
  return true;
}

class FastKernel : public c10::OperatorKernel {
 public:
  FastKernel(c10::OperatorHandle slow, int64_t handle_arg, int64_t op)
      : slow_(std::move(slow)), handle_arg_(handle_arg), op_(op) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    size_t n = op.schema().arguments().size();
    if (stack->size() >= n && try_launch(stack->data() + stack->size() - n, n, handle_arg_, op_)) {
      stack->erase(stack->end() - n, stack->end());   // (the ops return nothing)
      return;
    }
    slow_.redispatchBoxed(ks, stack);
  }

 private:
  c10::OperatorHandle slow_;
  int64_t handle_arg_;
  int64_t op_;
};

// Parse a record: `spec` as meld/runtime/torch_fastcall.py's `_spec` lays it out, `bytes` the launches' attributes
// and parameter blobs, in order.
std::unique_ptr<Record> parse(const int64_t* s, int64_t n, const unsigned char* bytes, int64_t nbytes) {
  auto r = std::make_unique<Record>();
  int64_t i = 0, b = 0;
  auto next = [&]() -> int64_t {
    TORCH_CHECK(i < n, "record spec too short");
    return s[i++];
  };
  r->op = next();
  for (int64_t k = next(); k > 0; --k) {
    Arg a;
    a.kind = next();
    if (a.kind == kTensor) {
      a.dtype = next(), a.device_type = next(), a.device_index = next(), a.pinned = next(), a.pinned_ptr = next(),
      a.written = next();
      int64_t dims = next();
      for (int64_t d = 0; d < dims; ++d) a.sizes.push_back(next());
      for (int64_t d = 0; d < dims; ++d) a.strides.push_back(next());
    } else if (a.kind == kDouble) {
      int64_t bits = next();
      std::memcpy(&a.value, &bits, sizeof bits);
    }
    r->args.push_back(std::move(a));
  }
  TORCH_CHECK(r->args.size() <= 16, "at most 16 arguments");
  for (int64_t k = next(); k > 0; --k) {
    Patch p{next(), next(), next(), next()};
    r->patches.push_back(p);
  }
  for (int64_t k = next(); k > 0; --k) {
    Launch l{};
    l.func = reinterpret_cast<void*>(next());
    for (unsigned& g : l.config.grid) g = static_cast<unsigned>(next());
    for (unsigned& g : l.config.block) g = static_cast<unsigned>(next());
    l.config.smem = static_cast<unsigned>(next());
    int64_t num_attrs = next(), blob = next();
    TORCH_CHECK(num_attrs >= 0 && blob >= 0 && b + num_attrs * int64_t(sizeof(LaunchAttr)) + blob <= nbytes,
                "record bytes too short");
    l.attrs.resize(num_attrs);
    std::memcpy(l.attrs.data(), bytes + b, num_attrs * sizeof(LaunchAttr));
    b += num_attrs * sizeof(LaunchAttr);
    l.blob.assign(bytes + b, bytes + b + blob);
    b += blob;
    r->launches.push_back(std::move(l));
  }
  r->device_type = next(), r->device_index = next();
  r->watchdog = reinterpret_cast<const volatile int32_t*>(next());
  TORCH_CHECK(i == n && b == nbytes, "record spec or bytes too long");
  for (Launch& l : r->launches) {   // (pointers into the record's own vectors: set once they stay put)
    l.config.attrs = l.attrs.empty() ? nullptr : l.attrs.data();
    l.config.num_attrs = static_cast<unsigned>(l.attrs.size());
    l.argv[0] = l.blob.data();
  }
  for (const Patch& p : r->patches)
    TORCH_CHECK(p.launch >= 0 && p.launch < int64_t(r->launches.size()) && p.arg >= 0 &&
                p.arg < int64_t(r->args.size()) && r->args[p.arg].kind == kTensor && p.offset >= 0 &&
                p.offset + 8 <= int64_t(r->launches[p.launch].blob.size()), "patch out of range");
  return r;
}

}  // namespace

extern "C" {

const char* meld_fc_error() { return last_error.c_str(); }

void meld_fc_set_launch(void* fn) { launch_fn.store(reinterpret_cast<LaunchFn>(fn)); }

int64_t meld_fc_hits() { return hits.load(); }

// Add a record of `handle` (replacing one of the same signature); -1 (meld_fc_error says why) for a malformed one,
// which changes nothing.
int meld_fc_push(int64_t handle, const int64_t* spec, int64_t n, const unsigned char* bytes, int64_t nbytes) {
  try {
    auto r = parse(spec, n, bytes, nbytes);
    int64_t pin_arg = -1;
    for (size_t i = 0; i < r->args.size() && pin_arg < 0; ++i)
      if (r->args[i].kind == kTensor && r->args[i].pinned) pin_arg = static_cast<int64_t>(i);
    uintptr_t key = pin_arg < 0 ? 0 : static_cast<uintptr_t>(r->args[pin_arg].pinned_ptr);
    std::lock_guard<std::mutex> lock(mu);
    Handle& h = handles[handle];
    if (h.pin_arg != pin_arg || (h.by_pin.size() >= kAddresses && !h.by_pin.count(key))) {
      h.by_pin.clear();   // (another kind of record, or too many addresses: start again)
      h.pin_arg = pin_arg;
    }
    auto& list = h.by_pin[key];
    for (auto it = list.begin(); it != list.end();) {   // (one record per signature: the new one replaces)
      it = same_signature(**it, *r) ? list.erase(it) : it + 1;
    }
    list.insert(list.begin(), std::move(r));
    if (list.size() > kPerAddress) list.pop_back();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

void meld_fc_drop(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu);
  handles.erase(handle);
}

// Register the fast kernel for op `name` ("ns::op") at dispatch key `key`, falling back to op `slow` (same schema)
// at the same keys; `handle_arg`: the index of the int argument naming the operator; `code`: the number its
// records carry.
int meld_fc_register(const char* name, const char* slow, int64_t handle_arg, const char* key, int64_t code) {
  try {
    auto slow_op = c10::Dispatcher::singleton().findSchemaOrThrow(slow, "");
    std::string full(name);
    size_t sep = full.find("::");
    TORCH_CHECK(sep != std::string::npos, "op name without a namespace: ", full);
    std::string ns = full.substr(0, sep), op = full.substr(sep + 2);
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::parseDispatchKey(key), __FILE__,
                                                __LINE__);
    lib->impl(op.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                              std::make_unique<FastKernel>(slow_op, handle_arg, code)));
    libraries.push_back(std::move(lib));
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

}  // extern "C"
