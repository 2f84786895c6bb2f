// Host hardware probes for preflight: CPU features, RAM (/proc/meminfo), GPUs (nvidia-smi), disk space.
// Parsers are separate from the probes so they can be tested on captured text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moesrv {

struct CpuInfo {
  std::string model;
  int logical_cores = 0;
  int physical_cores = 0;
  bool avx2 = false, fma = false, avx512f = false, avx512bw = false, avx512_vnni = false, avx512_bf16 = false,
       amx = false;
  std::string flags_summary() const;  // e.g. "AVX2 FMA AVX-512F AVX-512BW"
};

struct MemInfo {
  uint64_t total = 0, available = 0;  // bytes
};

struct GpuInfo {
  std::string name;
  uint64_t total = 0, used = 0;  // bytes
  uint64_t free() const { return total > used ? total - used : 0; }
};

struct DiskInfo {
  uint64_t total = 0, free = 0;  // bytes available to the user
};

CpuInfo parse_cpuinfo(const std::string& text);
MemInfo parse_meminfo(const std::string& text);
// Lines of `nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader[,nounits]` (MiB).
std::vector<GpuInfo> parse_nvidia_smi(const std::string& text);

CpuInfo probe_cpu();
MemInfo probe_memory();
std::vector<GpuInfo> probe_gpus();  // empty when nvidia-smi is absent or fails
DiskInfo probe_disk(const std::string& path);

}  // namespace moesrv
