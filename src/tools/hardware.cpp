#include "tools/hardware.h"

#include <sys/statvfs.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

namespace moesrv {

namespace {

std::string slurp(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string trim(std::string s) {
  s.erase(0, s.find_first_not_of(" \t\r\n"));
  s.erase(s.find_last_not_of(" \t\r\n") + 1);
  return s;
}

// "81559 MiB" or "81559" -> bytes (nvidia-smi reports MiB).
uint64_t mib_field(const std::string& s) { return uint64_t(std::strtoull(trim(s).c_str(), nullptr, 10)) << 20; }

}  // namespace

std::string CpuInfo::flags_summary() const {
  std::string out;
  auto add = [&](bool on, const char* name) {
    if (on) out += (out.empty() ? "" : " ") + std::string(name);
  };
  add(avx2, "AVX2");
  add(fma, "FMA");
  add(avx512f, "AVX-512F");
  add(avx512bw, "AVX-512BW");
  add(avx512_vnni, "AVX-512-VNNI");
  add(avx512_bf16, "AVX-512-BF16");
  add(amx, "AMX");
  return out.empty() ? "no AVX2" : out;
}

CpuInfo parse_cpuinfo(const std::string& text) {
  CpuInfo c;
  std::set<std::pair<std::string, std::string>> cores;  // (physical id, core id)
  std::string phys;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = trim(line.substr(0, colon)), val = trim(line.substr(colon + 1));
    if (key == "processor") ++c.logical_cores;
    else if (key == "model name" && c.model.empty()) c.model = val;
    else if (key == "physical id") phys = val;
    else if (key == "core id") cores.insert({phys, val});
    else if (key == "flags" && c.logical_cores <= 1) {
      std::istringstream fs(" " + val + " ");
      std::set<std::string> flags;
      for (std::string f; fs >> f;) flags.insert(f);
      c.avx2 = flags.count("avx2");
      c.fma = flags.count("fma");
      c.avx512f = flags.count("avx512f");
      c.avx512bw = flags.count("avx512bw");
      c.avx512_vnni = flags.count("avx512_vnni");
      c.avx512_bf16 = flags.count("avx512_bf16");
      c.amx = flags.count("amx_tile");
    }
  }
  c.physical_cores = cores.empty() ? c.logical_cores : int(cores.size());
  return c;
}

MemInfo parse_meminfo(const std::string& text) {
  MemInfo m;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string key;
    uint64_t kb = 0;
    ls >> key >> kb;
    if (key == "MemTotal:") m.total = kb << 10;
    else if (key == "MemAvailable:") m.available = kb << 10;
  }
  return m;
}

std::vector<GpuInfo> parse_nvidia_smi(const std::string& text) {
  std::vector<GpuInfo> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    // name may itself contain commas: take the last two fields as the numbers
    auto c2 = line.rfind(',');
    if (c2 == std::string::npos) continue;
    auto c1 = line.rfind(',', c2 - 1);
    if (c1 == std::string::npos || c1 == 0) continue;
    GpuInfo g{trim(line.substr(0, c1)), mib_field(line.substr(c1 + 1, c2 - c1 - 1)), mib_field(line.substr(c2 + 1))};
    if (g.total > 0) out.push_back(g);
  }
  return out;
}

CpuInfo probe_cpu() {
  CpuInfo c = parse_cpuinfo(slurp("/proc/cpuinfo"));
  if (c.logical_cores == 0) c.logical_cores = c.physical_cores = int(std::thread::hardware_concurrency());
  return c;
}

MemInfo probe_memory() { return parse_meminfo(slurp("/proc/meminfo")); }

std::vector<GpuInfo> probe_gpus() {
  FILE* p =
      popen("nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader,nounits 2>/dev/null", "r");
  if (!p) return {};
  std::string text;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  int rc = pclose(p);
  return rc == 0 ? parse_nvidia_smi(text) : std::vector<GpuInfo>{};
}

DiskInfo probe_disk(const std::string& path) {
  struct statvfs s {};
  if (statvfs(path.c_str(), &s) != 0) return {};
  return {uint64_t(s.f_blocks) * s.f_frsize, uint64_t(s.f_bavail) * s.f_frsize};
}

}  // namespace moesrv
