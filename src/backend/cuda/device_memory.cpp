// CUDA engine memory: the VRAM budget, device and pinned buffers, and the weight uploads (bf16 rows of any
// stored format, or EXL3 linears as they are stored: trellis | suh | svh).
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <algorithm>
#include <cstring>
#include <utility>

#include "backend/cpu/exl3_linear.h"
#include "backend/cuda/engine_internal.h"

namespace moesrv::cuda {

// Never throws (also used on release paths); a failed switch shows in the next CUDA call.
DeviceGuard::DeviceGuard(int device) {
  int cur = 0;
  if (cudaGetDevice(&cur) != cudaSuccess || cur == device) return;
  if (cudaSetDevice(device) == cudaSuccess) prev_ = cur;
}
DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) cudaSetDevice(prev_);
}

void* DeviceBudget::alloc(size_t bytes, const char* what) {
  std::lock_guard lk(mu_);
  std::optional<DeviceGuard> on;
  if (device_ >= 0) on.emplace(device_);
  if (used_ + bytes > limit_)
    fail("VRAM budget exceeded: {} needs {:.1f} MiB, {:.1f} of {:.1f} MiB in use", what, double(bytes) / 1048576.0,
         double(used_) / 1048576.0, double(limit_) / 1048576.0);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an out-of-memory error must not be reported again by the next launch check
    fail("cudaMalloc of {} bytes for {} failed: {}", bytes, what, cudaGetErrorString(e));
  }
  used_ += bytes;
  return p;
}

void DeviceBudget::release(void* p, size_t bytes) {
  std::lock_guard lk(mu_);
  std::optional<DeviceGuard> on;
  if (device_ >= 0) on.emplace(device_);
  cudaFree(p);
  used_ -= bytes;
}

DeviceBuffer::DeviceBuffer(std::shared_ptr<DeviceBudget> b, size_t bytes, const char* what)
    : budget_(std::move(b)), bytes_(bytes) {
  ptr_ = budget_->alloc(bytes, what);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    budget_ = std::move(o.budget_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (ptr_ && budget_) budget_->release(ptr_, bytes_);
  ptr_ = nullptr;
  bytes_ = 0;
}

PinnedBuffer::PinnedBuffer(size_t bytes, bool mapped) : bytes_(bytes) {
  MOESRV_CUDA_OK(cudaHostAlloc(&ptr_, std::max<size_t>(bytes, 1), mapped ? cudaHostAllocMapped : cudaHostAllocDefault));
  if (!mapped) return;
  const cudaError_t err = cudaHostGetDevicePointer(&dev_, ptr_, 0);
  if (err == cudaSuccess) return;
  cudaFreeHost(std::exchange(ptr_, nullptr));  // (no destructor runs for a constructor that throws)
  MOESRV_CUDA_OK(err);
}
PinnedBuffer::~PinnedBuffer() {
  if (ptr_) cudaFreeHost(ptr_);
}
PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFreeHost(ptr_);
    ptr_ = o.ptr_;
    dev_ = o.dev_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
  }
  return *this;
}

uint16_t f32_to_bf16_host(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

void append_bf16_rows(const Linear& l, std::vector<uint16_t>& out) {
  const int64_t in = l.in_features(), block = std::max<int64_t>(1, (int64_t(16) << 20) / std::max<int64_t>(in, 1));
  std::vector<float> tmp;
  for (int64_t r = 0; r < l.out_features(); r += block) {
    const int64_t e = std::min(l.out_features(), r + block);
    tmp.resize(size_t((e - r) * in));
    l.dequant_rows(r, e, tmp.data());
    for (float v : tmp) out.push_back(f32_to_bf16_host(v));
  }
}

Exl3Dev rebase(const Exl3Dev& off, const void* base) {
  auto at = [&](const void* o) { return static_cast<const uint8_t*>(base) + reinterpret_cast<uintptr_t>(o); };
  Exl3Dev d = off;
  d.trellis = at(off.trellis);
  d.suh = reinterpret_cast<const uint16_t*>(at(off.suh));
  d.svh = reinterpret_cast<const uint16_t*>(at(off.svh));
  return d;
}

namespace {

// Lays out pieces 16-byte aligned; copies them when `blob` is given. put() returns the offset as a pointer.
struct BlockWriter {
  std::vector<uint8_t>* blob = nullptr;
  size_t size = 0;
  const void* put(const void* src, size_t bytes) {
    const size_t off = (size + 15) & ~size_t(15);
    size = off + bytes;
    if (blob) {
      blob->resize(size);
      std::memcpy(blob->data() + off, src, bytes);
    }
    return reinterpret_cast<const void*>(uintptr_t(off));
  }
};

// Appends an EXL3 linear's device form (trellis | suh | svh as fp16); returns it with offsets as pointers.
Exl3Dev append_exl3(const Exl3Linear& l, BlockWriter& out) {
  const Exl3Weights& w = l.weights();
  Exl3Dev d;
  d.K = w.K;
  d.cb = exl3_cb_index(w.codebook);
  d.in_pad = int(w.in_pad);
  d.out_pad = int(w.out_pad);
  d.in = int(l.in_features());
  d.out = int(l.out_features());
  auto put_f16 = [&](const std::vector<float>& v) {
    std::vector<uint16_t> h(out.blob ? v.size() : 0);
    for (size_t i = 0; i < h.size(); ++i) h[i] = f64_to_f16_rne(v[i]);  // exact: the values came from fp16
    return static_cast<const uint16_t*>(out.put(h.data(), v.size() * 2));
  };
  d.trellis = out.put(w.trellis, w.trellis_bytes());
  d.suh = put_f16(w.suh);
  d.svh = put_f16(w.svh);
  return d;
}

}  // namespace

const Exl3Linear* as_exl3(const Linear* l) { return dynamic_cast<const Exl3Linear*>(l); }

DeviceBuffer WeightUploader::raw(const void* data, size_t bytes, const char* what) {
  DeviceBuffer d(budget, bytes, what);
  MOESRV_CUDA_OK(cudaMemcpy(d.as<void>(), data, bytes, cudaMemcpyHostToDevice));
  weight_bytes += bytes;
  return d;
}

DevLinear WeightUploader::linear(std::initializer_list<const Linear*> parts, const char* what) {
  DevLinear d;
  std::vector<float> bias;
  bool exl3 = true;
  for (const Linear* l : parts) {
    d.in = l->in_features();
    d.out += l->out_features();
    exl3 = exl3 && as_exl3(l);
    if (!l->bias().empty()) bias.insert(bias.end(), l->bias().begin(), l->bias().end());
  }
  if (!bias.empty() && int64_t(bias.size()) != d.out) fail("{}: bias on some parts only", what);
  if (exl3) {  // each part as stored, back to back
    std::vector<uint8_t> blob;
    BlockWriter out{&blob};
    int64_t col0 = 0;
    for (const Linear* l : parts) {
      d.x3.push_back({append_exl3(*as_exl3(l), out), col0});
      col0 += l->out_features();
    }
    d.w = raw(blob.data(), blob.size(), what);
    exl3_bytes += blob.size();
    for (Exl3Part& p : d.x3) p.w = rebase(p.w, d.w.as<void>());
    if (d.x3.size() > 1 && bias.empty()) {
      std::vector<Exl3Dev> w;
      for (const Exl3Part& p : d.x3) w.push_back(p.w);
      d.parts = group(w);
    }
  } else {
    std::vector<uint16_t> w;
    for (const Linear* l : parts) append_bf16_rows(*l, w);
    d.w = vec(w, what);
  }
  if (!bias.empty()) d.bias = vec(bias, what);
  return d;
}

DevGroup WeightUploader::group(const std::vector<Exl3Dev>& w) {
  DevGroup g;
  if (w.size() < 2) return g;
  for (const Exl3Dev& x : w)
    if (x.K != w[0].K || x.cb != w[0].cb || x.in_pad != w[0].in_pad || x.out_pad != w[0].out_pad || x.in != w[0].in ||
        x.out != w[0].out)
      return g;
  std::vector<int32_t> ids(w.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  g.tab = raw(w.data(), w.size() * sizeof(Exl3Dev), "EXL3 group table");
  g.ids = raw(ids.data(), ids.size() * sizeof(int32_t), "EXL3 group table");
  weight_bytes -= g.tab.bytes() + g.ids.bytes();  // tables, not weights
  g.count = int(w.size());
  return g;
}

DevGroup WeightUploader::pair(const DevLinear& a, const DevLinear& b) {
  if (a.x3.size() != 1 || b.x3.size() != 1 || a.bias.bytes() || b.bias.bytes()) return {};
  return group({a.x3[0].w, b.x3[0].w});
}

DevNorm WeightUploader::norm(const NormWeights& n) {
  DevNorm d;
  d.w = vec(n.weight, "norm");
  if (!n.bias.empty()) d.b = vec(n.bias, "norm bias");
  return d;
}

DevMlp WeightUploader::mlp(const MlpWeights& m, const char* what) {
  DevMlp d;
  d.gate_up = linear({m.gate.get(), m.up.get()}, what);
  d.down = linear({m.down.get()}, what);
  d.inter = m.gate->out_features();
  d.limit = m.limit;
  return d;
}

bool exl3_experts(const MoeWeights& m) {
  for (const MlpWeights& e : m.experts)
    if (!as_exl3(e.gate.get()) || !as_exl3(e.up.get()) || !as_exl3(e.down.get())) return false;
  return !m.experts.empty();
}

size_t expert_block(const MlpWeights& m, bool exl3, std::array<Exl3Dev, 3>* off, std::vector<uint8_t>* blob) {
  BlockWriter out{blob};
  if (exl3) {
    (*off)[0] = append_exl3(*as_exl3(m.gate.get()), out);
    (*off)[1] = append_exl3(*as_exl3(m.up.get()), out);
    (*off)[2] = append_exl3(*as_exl3(m.down.get()), out);
    return out.size;
  }
  std::vector<uint16_t> w;
  if (blob) {
    append_bf16_rows(*m.gate, w);
    append_bf16_rows(*m.up, w);
    append_bf16_rows(*m.down, w);
  }
  out.put(
      w.data(),
      size_t(2 * m.gate->out_features() * m.gate->in_features() + m.down->out_features() * m.down->in_features()) * 2);
  return out.size;
}

}  // namespace moesrv::cuda
#endif  // MOESRV_HAS_CUDA
