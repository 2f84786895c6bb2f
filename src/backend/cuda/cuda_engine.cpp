// CUDA engine: the layer loop, chunked prefill, decode graphs and decode steps of several sequences (their state:
// cuda_sequence.h; the blocks: cuda_blocks.h; the MTP block: mtp_engine.cpp).
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include "backend/cuda/cuda_engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>

#include "backend/cuda/cuda_blocks.h"
#include "backend/cuda/cuda_sequence.h"

namespace moesrv {

using namespace moesrv::cuda;

void CudaEngine::Impl::gemm_bf16(const uint16_t* w, int64_t out, int64_t in, const uint16_t* xb, int64_t n, float* y) {
  const float alpha = 1.0f, beta = 0.0f;
  MOESRV_CUBLAS_OK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(n), int(in), &alpha, w, CUDA_R_16BF,
                                int(in), xb, CUDA_R_16BF, int(in), &beta, y, CUDA_R_32F, int(out), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}

void CudaEngine::Impl::linear(const DevLinear& l, const float* x, int64_t n, float* y) {
  // One token through parts of one shape (q|k|v, gate|up): row r of the group is part r's columns.
  if (n == 1 && l.parts && l.parts.count <= kExl3MaxGemvRows) {
    const Exl3Dev& w = l.x3[0].w;
    return exl3_group(l.parts, w, Exl3Src{x, l.in, nullptr, l.parts.count}, y, w.out);
  }
  if (!l.x3.empty()) {  // EXL3 parts, each into its output columns
    for (const Exl3Part& p : l.x3)
      exl3_forward(p.w, Exl3Src{x, l.in}, n, y + p.col0, l.out, l.bias.bytes() ? l.bias.as<float>() + p.col0 : nullptr);
    return;
  }
  if (n <= kBf16GemvMaxRows)
    return bf16_gemv(l.w.as<uint16_t>(), int(l.out), int(l.in), x, int(n),
                     l.bias.bytes() ? l.bias.as<float>() : nullptr, y, stream);
  to_bf16(x, n * l.in, s.xb.as<uint16_t>(), stream);
  gemm_bf16(l.w.as<uint16_t>(), l.out, l.in, s.xb.as<uint16_t>(), n, y);
  if (l.bias.bytes()) add_bias(y, l.bias.as<float>(), int(n), int(l.out), stream);
}

void CudaEngine::Impl::mlp(const DevMlp& m, const float* x, int64_t n, float* y) {
  for (int64_t r0 = 0; r0 < n; r0 += rows) {  // s.gu / s.act hold a pass's rows (a prefill group has more)
    const int64_t cnt = std::min(rows, n - r0);
    linear(m.gate_up, x + r0 * m.gate_up.in, cnt, s.gu.as<float>());
    silu_mul_clamped(s.gu.as<float>(), int(cnt), int(m.inter), m.limit, s.act.as<float>(), stream);
    linear(m.down, s.act.as<float>(), cnt, y + r0 * m.down.out);
  }
}

// Embedding, the decoder loop, the final norm for S tokens at device positions; leaves normalised rows in s.h.
void CudaEngine::Impl::run_layers(int64_t S, const GroupPasses* group) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOESRV_CUDA_OK(cudaStreamIsCapturing(stream, &capture));
  clock.begin(opt.time_phases && S > 1 && capture == cudaStreamCaptureStatusNone);  // (its finish() synchronises)
  phase(CudaPhase::Residual);
  CudaBlocks blocks(*this, S, nullptr, group);
  blocks.embed();
  run_decoder_layers(c, blocks, 0, c.num_layers);
  blocks.final_norm(final_norm);
  phase(CudaPhase::Residual);  // the last interval's end
  clock.finish(stats.phase_s);
}

void CudaEngine::Impl::run_block_layers(int64_t S) {
  CudaBlocks blocks(*this, S);
  run_decoder_layers(c, blocks, 0, c.num_layers);
  blocks.final_norm(final_norm);
}

void CudaEngine::Impl::lm_head_rows(int64_t row0, int64_t n, float* host_out) {
  const int64_t V = c.vocab_size;
  for (int64_t r = 0; r < n; r += lm_rows) {
    const int64_t m = std::min(lm_rows, n - r);
    linear(lm_head, s.h.as<float>() + (row0 + r) * c.hidden_size, m, s.logits.as<float>());
    MOESRV_CUDA_OK(cudaMemcpyAsync(h_logits.as<float>(), s.logits.as<float>(), size_t(m * V) * 4, cudaMemcpyDeviceToHost, stream));
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
    std::memcpy(host_out + r * V, h_logits.as<float>(), size_t(m * V) * 4);
  }
}

const int32_t* CudaEngine::Impl::slice_pos0(int64_t s0) {
  if (s0 == 0) return d_pos0.as<int32_t>();
  offset_position(d_pos0.as<int32_t>(), int(s0), d_slice_pos.as<int32_t>(), stream);
  return d_slice_pos.as<int32_t>();
}

namespace {

// The entry of `key` in an LRU of at most `max` graphs (null until captured), created if missing.
template <class K>
cudaGraphExec_t& lru_entry(std::map<K, cudaGraphExec_t>& graphs, std::deque<K>& order, const K& key, size_t max) {
  auto it = graphs.find(key);
  if (it != graphs.end()) {
    order.erase(std::find(order.begin(), order.end(), key));
    order.push_back(key);
    return it->second;
  }
  if (graphs.size() == max) {
    auto old = graphs.find(order.front());
    if (old->second) cudaGraphExecDestroy(old->second);
    graphs.erase(old);
    order.pop_front();
  }
  order.push_back(key);
  return graphs[key];
}

}  // namespace

cudaGraphExec_t& SequenceGraphs::get(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  return lru_entry(graphs, order, id, kMax);
}

cudaGraphExec_t& SequenceGraphs::batch(const std::vector<uint64_t>& key) {
  std::lock_guard<std::mutex> lock(mu);
  return lru_entry(batches, batch_order, key, kMax);
}

void SequenceGraphs::drop(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto b = batches.begin(); b != batches.end();) {
    if (b->first.size() > 2 && std::find(b->first.begin() + 2, b->first.end(), id) != b->first.end()) {
      if (b->second) cudaGraphExecDestroy(b->second);
      batch_order.erase(std::find(batch_order.begin(), batch_order.end(), b->first));
      b = batches.erase(b);
    } else {
      ++b;
    }
  }
  auto it = graphs.find(id);
  if (it == graphs.end()) return;
  if (it->second) cudaGraphExecDestroy(it->second);
  graphs.erase(it);
  order.erase(std::find(order.begin(), order.end(), id));
}

void SequenceGraphs::clear() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [id, g] : graphs)
    if (g) cudaGraphExecDestroy(g);
  for (auto& [key, g] : batches)
    if (g) cudaGraphExecDestroy(g);
  graphs.clear();
  order.clear();
  batches.clear();
  batch_order.clear();
}

// Adds the device counters into `usage` and zeroes them (32-bit counters: drained at every read).
const UsageStats* CudaEngine::Impl::drain_usage() const {
  if (!usage) return nullptr;
  const int64_t E = c.n_routed_experts, L = c.num_layers;
  std::vector<uint32_t> counts(static_cast<size_t>(L * E)), tokens(static_cast<size_t>(L));
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  MOESRV_CUDA_OK(cudaMemcpy(counts.data(), d_usage.as<void>(), counts.size() * 4, cudaMemcpyDeviceToHost));
  MOESRV_CUDA_OK(cudaMemcpy(tokens.data(), d_usage_tokens.as<void>(), tokens.size() * 4, cudaMemcpyDeviceToHost));
  MOESRV_CUDA_OK(cudaMemset(d_usage.as<void>(), 0, d_usage.bytes()));
  MOESRV_CUDA_OK(cudaMemset(d_usage_tokens.as<void>(), 0, d_usage_tokens.bytes()));
  for (int64_t l = 0; l < L; ++l)
    if (tokens[size_t(l)]) usage->add_counts(l, counts.data() + l * E, double(tokens[size_t(l)]));
  for (int64_t l = 0; l < L && l < int64_t(layers.size()); ++l) {  // the zero-copy layers' selections of host experts
    const DevMoe* m = layers[size_t(l)].moe ? &*layers[size_t(l)].moe : nullptr;
    if (!m || !m->zero_copy) continue;
    for (int64_t e = 0; e < E; ++e)
      if (m->placement[size_t(e)] != ExpertPlacement::Vram) {
        zero_copy_selections += counts[size_t(l * E + e)];
        zero_copy_bytes += double(counts[size_t(l * E + e)]) * double(m->block_bytes[size_t(e)]);
      }
  }
  return usage.get();
}

int64_t CudaEngine::Impl::graph_rows() const {
  static const int64_t env = [] {
    const char* v = std::getenv("MOESRV_CUDA_GRAPH_ROWS");
    return v ? std::clamp<int64_t>(std::atoi(v), 1, kMaxGraphRows) : 1;
  }();
  return std::min(env, lm_rows);
}

void CudaEngine::Impl::check_tokens(int64_t pos0, const int32_t* tokens, int64_t n) const {
  if (pos0 + n > max_ctx) fail("context length exceeded: {} + {} tokens > {}", pos0, n, max_ctx);
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      fail("token id {} outside vocabulary [0, {})", tokens[i], c.vocab_size);
}

bool CudaEngine::Impl::graph_ok() const {
  if (!use_graph) return false;
  for (const auto& L : layers)
    if (L.moe && (!(L.moe->all_vram || L.moe->zero_copy) || (L.moe->exl3 && !L.moe->x3_grouped))) return false;
  return true;
}

CudaEngine::CudaEngine(std::shared_ptr<ModelPackage> pkg, const CudaEngineOptions& opt)
    : impl_(std::make_unique<Impl>(std::move(pkg), opt)) {}
CudaEngine::~CudaEngine() = default;

std::string CudaEngine::name() const { return impl_->name; }
int64_t CudaEngine::vocab_size() const { return impl_->c.vocab_size; }
int64_t CudaEngine::max_context() const { return impl_->max_ctx; }
int64_t CudaEngine::prefill_chunk() const { return impl_->group_rows(); }
std::unique_ptr<SequenceState> CudaEngine::new_sequence() const { return std::make_unique<CudaSequence>(*impl_); }
void CudaEngine::set_use_graph(bool on) {
  impl_->use_graph = on;
  if (impl_->mtp) impl_->mtp->use_graph = on;
}
uint64_t CudaEngine::sequence_bytes(int64_t) const {
  return impl_->seq_bytes + (impl_->mtp ? impl_->mtp->seq_bytes : 0);
}
const UsageStats* CudaEngine::expert_usage() const {
  const Impl::DeviceLock lock(*impl_->device_mu);
  return impl_->drain_usage();
}
const std::vector<std::vector<ExpertPlacement>>& CudaEngine::placement() const { return impl_->placement; }
CudaEngineStats CudaEngine::stats() const {
  CudaEngineStats st = impl_->stats;
  if (st.zero_copy_layers) {
    impl_->drain_usage();
    st.zero_copy_selections = impl_->zero_copy_selections;
    st.zero_copy_bytes = impl_->zero_copy_bytes;
  }
  if (impl_->expert_cache) {
    const ExpertCacheStats cs = impl_->expert_cache->total_stats();
    st.cache_hits = int64_t(cs.hits);
    st.cache_misses = int64_t(cs.misses);
  }
  st.vram_used = impl_->budget->used();
  st.hybrid_lanes = impl_->lanes_have_scratch ? int(impl_->expert_lanes.size()) : 0;
  st.hybrid_lanes_copied = impl_->lanes_copied_on();
  st.stream_window = impl_->stream_window_slots();
  st.weight_bytes = impl_->up.weight_bytes;
  st.exl3_weight_bytes = impl_->up.exl3_bytes;
  return st;
}

const char* cuda_phase_name(CudaPhase p) {
  static const char* const names[] = {"residual",    "attn_proj",   "indexer", "attn_absorb", "attn_core",
                                      "linear_proj", "linear_core", "router",  "experts",     "mlp"};
  static_assert(std::size(names) == size_t(CudaPhase::Count));
  return p >= CudaPhase::Residual && p < CudaPhase::Count ? names[int(p)] : "?";
}

void CudaEngine::Impl::replay(cudaGraphExec_t& graph, const std::function<void()>& body) {
  Impl& m = *this;
  if (!graph) {
    cudaGraph_t g = nullptr;
    MOESRV_CUDA_OK(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      cudaStreamEndCapture(m.stream, &g);
      if (g) cudaGraphDestroy(g);
      throw;
    }
    MOESRV_CUDA_OK(cudaStreamEndCapture(m.stream, &g));
    size_t nodes = 0;
    MOESRV_CUDA_OK(cudaGraphGetNodes(g, nullptr, &nodes));
    m.stats.graph_nodes = int64_t(nodes);
    MOESRV_CUDA_OK(cudaGraphInstantiate(&graph, g, 0));
    cudaGraphDestroy(g);
    ++m.stats.graph_captures;
  }
  MOESRV_CUDA_OK(cudaGraphLaunch(graph, m.stream));
  ++m.stats.graph_replays;
}

std::vector<float> CudaEngine::forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits) {
  const Impl::DeviceLock lock(*impl_->device_mu);
  return impl_->forward(seq, tokens, all_logits, nullptr);
}

int32_t CudaEngine::forward_argmax(SequenceState& seq, const std::vector<int32_t>& tokens) {
  static const SwitchOverride env("MOESRV_DEVICE_ARGMAX");
  if (!env(impl_->opt.device_argmax)) return Engine::forward_argmax(seq, tokens);
  const Impl::DeviceLock lock(*impl_->device_mu);
  int32_t best = 0;
  impl_->forward(seq, tokens, false, &best);
  return best;
}

std::vector<float> CudaEngine::argmax_logits() {
  Impl& m = *impl_;
  if (!m.argmax_row) return Engine::argmax_logits();  // (the default forward_argmax's row)
  const Impl::DeviceLock lock(*m.device_mu);
  const int64_t V = m.c.vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  MOESRV_CUDA_OK(
      cudaMemcpyAsync(m.h_logits.as<float>(), m.argmax_row, size_t(V) * 4, cudaMemcpyDeviceToHost, m.stream));
  MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));
  std::memcpy(logits.data(), m.h_logits.as<float>(), size_t(V) * 4);
  return logits;
}

std::vector<float> CudaEngine::Impl::forward(SequenceState& seq_base, const std::vector<int32_t>& tokens,
                                             bool all_logits, int32_t* best, bool rollback,
                                             std::vector<float>* hidden) {
  CudaSequence* seq = &own_sequence(*this, seq_base, "forward");
  if (layer_begin != 0 || layer_end != c.num_layers)
    fail("forward: this engine holds layers [{}, {}) of {} (a pipeline stage: use embed / forward_layers / logits)",
         layer_begin, layer_end, c.num_layers);
  const int64_t S = int64_t(tokens.size()), V = c.vocab_size, pos0 = seq->length();
  if (S == 0) fail("forward: no tokens");
  check_tokens(pos0, tokens.data(), S);
  if (rollback && (S > kMaxRollbackRows || S > rows))  // (one pass: the multi-token kernels write the points)
    fail("forward: {} tokens with rollback points (at most {} and the pass length {})", S, kMaxRollbackRows, rows);
  pass_mode(S);
  argmax_row = nullptr;
  std::vector<float> logits(best ? 0 : size_t((all_logits ? S : 1) * V));
  if (hidden) hidden->assign(size_t(S * c.hidden_size), 0.0f);
  const bool steps = seq->begin_forward(rollback ? S : 0);
  bind_sequence(*this, *seq, steps);
  // Greedy (best): the last row's argmax on the device, 4 bytes back; the row stays in s.logits (argmax_logits).
  auto pick = [&](const float* row) {
    argmax(row, int(V), d_argmax.as<char>() + 16, d_argmax.as<int32_t>(), stream);
    MOESRV_CUDA_OK(cudaMemcpyAsync(h_argmax.as<void>(), d_argmax.as<void>(), 4, cudaMemcpyDeviceToHost, stream));
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
    *best = *h_argmax.as<int32_t>();
    argmax_row = row;
  };
  // The head inputs of a pass's rows, after its head (which leaves s.h as it is).
  auto keep_hidden = [&](int64_t c0, int64_t n) {
    if (!hidden) return;
    MOESRV_CUDA_OK(cudaMemcpyAsync(hidden->data() + c0 * c.hidden_size, s.h.as<float>(), size_t(n * c.hidden_size) * 4,
                                   cudaMemcpyDeviceToHost, stream));
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  };
  // With prefill groups the plan's passes are groups (of group_rows(), checkpointed as the policy says), each run
  // layer by layer as passes of `rows`.
  for_each_pass(grouped_policy(pass_policy(), group_rows()), *seq, pos0, S, rollback, [&](const Pass& p) {
    const int64_t n = p.rows, c0 = p.offset;
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));  // pinned staging is free again
    GroupPasses group;
    group.d_pos = d_group_pos.as<int32_t>();
    if (n > rows) {  // a group: its passes' positions
      group.parts = group_parts(p, rows);
      for (size_t i = 0; i < group.parts.size(); ++i)
        h_group_pos.as<int32_t>()[i] = int32_t(p.pos0 + group.parts[i].first);
      MOESRV_CUDA_OK(cudaMemcpyAsync(d_group_pos.as<void>(), h_group_pos.as<void>(), group.parts.size() * 4,
                                     cudaMemcpyHostToDevice, stream));
    } else {
      *h_pos0.as<int32_t>() = int32_t(p.pos0);
      MOESRV_CUDA_OK(cudaMemcpyAsync(d_pos0.as<void>(), h_pos0.as<void>(), 4, cudaMemcpyHostToDevice, stream));
    }
    std::memcpy(h_tokens.as<int32_t>(), tokens.data() + c0, size_t(n) * 4);
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(d_tokens.as<void>(), h_tokens.as<void>(), size_t(n) * 4, cudaMemcpyHostToDevice, stream));
    // A verify (rollback) replays graphs of its row count too.
    if (group.parts.empty() && (n <= graph_rows() || (rollback && n <= std::min(kMaxRollbackRows, lm_rows))) &&
        graph_ok()) {
      // Kernels of fixed-size state take the sequence's pointers: such models keep graphs per sequence (and per
      // row count, with or without rollback points); the others one per row count.
      const uint64_t key = rows_graph_key(seq->id, n) | (steps ? kRollbackGraph : 0);
      cudaGraphExec_t& graph = seq->has_fixed_state() ? sequence_graphs->get(key) : graphs[size_t(n - 1)];
      replay(graph, [&] {
        run_layers(n);
        linear(lm_head, s.h.as<float>(), n, s.logits.as<float>());
      });
      const int64_t r0 = all_logits ? 0 : n - 1, rows = all_logits ? n : 1;  // the logits rows returned
      keep_hidden(c0, n);
      if (best) {
        if (p.last) pick(s.logits.as<float>() + r0 * V);
      } else {
        MOESRV_CUDA_OK(cudaMemcpyAsync(h_logits.as<float>(), s.logits.as<float>() + r0 * V, size_t(rows * V) * 4,
                                       cudaMemcpyDeviceToHost, stream));
        MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
        if (all_logits || p.last)
          std::memcpy(logits.data() + (all_logits ? c0 * V : 0), h_logits.as<float>(), size_t(rows * V) * 4);
      }
    } else {
      run_layers(n, group.parts.empty() ? nullptr : &group);
      keep_hidden(c0, n);
      if (best && p.last) {
        linear(lm_head, s.h.as<float>() + (n - 1) * c.hidden_size, 1, s.logits.as<float>());
        pick(s.logits.as<float>());
      } else if (all_logits) {
        lm_head_rows(0, n, logits.data() + c0 * V);
      } else if (p.last && !best) {
        lm_head_rows(n - 1, 1, logits.data());
      }
    }
  });
  seq->end_forward(pos0, S, steps);
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  return logits;
}

std::vector<std::vector<float>> CudaEngine::Impl::forward_rows(const std::vector<SequenceState*>& seqs,
                                                               const std::vector<int32_t>& tokens) {
  const int64_t B = int64_t(seqs.size()), V = c.vocab_size, L = c.num_layers;
  pass_mode(B);
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));  // pinned staging is free again
  BatchRows rows;
  rows.d_pos = d_batch_pos.as<int32_t>();
  rows.d_tables = d_batch_tables.as<DeviceLayerCache>();
  std::vector<uint64_t> key{0, uint64_t(B)};  // + the ids when a row's state pointers are baked in
  bool fixed = false;
  for (int64_t b = 0; b < B; ++b) {
    CudaSequence& seq = own_sequence(*this, *seqs[size_t(b)], "forward_batch");
    seq.begin_forward(0);
    h_batch_pos.as<int32_t>()[b] = int32_t(seq.length());
    std::memcpy(h_batch_tables.as<DeviceLayerCache>() + b * L, seq.table.data(), size_t(L) * sizeof(DeviceLayerCache));
    rows.states.emplace_back();
    for (size_t l = 0; l < seq.layers.size(); ++l) rows.states.back().push_back(seq.state(l));
    fixed |= seq.has_fixed_state();
    key.push_back(seq.id);
  }
  if (!fixed) key.resize(2);
  std::memcpy(h_tokens.as<int32_t>(), tokens.data(), size_t(B) * 4);
  MOESRV_CUDA_OK(
      cudaMemcpyAsync(d_tokens.as<void>(), h_tokens.as<void>(), size_t(B) * 4, cudaMemcpyHostToDevice, stream));
  MOESRV_CUDA_OK(
      cudaMemcpyAsync(d_batch_pos.as<void>(), h_batch_pos.as<void>(), size_t(B) * 4, cudaMemcpyHostToDevice, stream));
  MOESRV_CUDA_OK(cudaMemcpyAsync(d_batch_tables.as<void>(), h_batch_tables.as<void>(),
                                 size_t(B * L) * sizeof(DeviceLayerCache), cudaMemcpyHostToDevice, stream));
  argmax_row = nullptr;
  auto body = [&] {
    CudaBlocks blocks(*this, B, &rows);
    blocks.embed();
    run_decoder_layers(c, blocks, 0, c.num_layers);
    blocks.final_norm(final_norm);
    linear(lm_head, s.h.as<float>(), B, s.logits.as<float>());
  };
  if (graph_ok()) replay(sequence_graphs->batch(key), body);
  else body();
  MOESRV_CUDA_OK(
      cudaMemcpyAsync(h_logits.as<float>(), s.logits.as<float>(), size_t(B * V) * 4, cudaMemcpyDeviceToHost, stream));
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<std::vector<float>> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    out[size_t(b)].assign(h_logits.as<float>() + b * V, h_logits.as<float>() + (b + 1) * V);
    dynamic_cast<CudaSequence&>(*seqs[size_t(b)]).length_ += 1;
  }
  return out;
}

std::vector<std::vector<float>> CudaEngine::forward_batch(const std::vector<SequenceState*>& seqs,
                                                          const std::vector<int32_t>& tokens) {
  Impl& m = *impl_;
  static const bool on = switch_on("MOESRV_CUDA_BATCH");  // 0: one forward per sequence (comparisons)
  MOESRV_CHECK(seqs.size() == tokens.size(), "forward_batch: {} sequences, {} tokens", seqs.size(), tokens.size());
  if (!on || seqs.size() < 2 || m.layer_begin != 0 || m.layer_end != m.c.num_layers || m.kMaxBatchRows > m.lm_rows)
    return Engine::forward_batch(seqs, tokens);
  const Impl::DeviceLock lock(*m.device_mu);
  for (size_t i = 0; i < seqs.size(); ++i) {
    m.check_tokens(own_sequence(m, *seqs[i], "forward_batch").length(), &tokens[i], 1);
    for (size_t j = 0; j < i; ++j)
      if (seqs[j] == seqs[i]) fail("forward_batch: sequence {} given twice", i);
  }
  std::vector<std::vector<float>> out;
  out.reserve(seqs.size());
  for (size_t i = 0; i < seqs.size(); i += size_t(Impl::kMaxBatchRows)) {
    const size_t n = std::min(seqs.size() - i, size_t(Impl::kMaxBatchRows));
    if (n == 1) {
      out.push_back(m.forward(*seqs[i], {tokens[i]}, false, nullptr));
      continue;
    }
    auto part = m.forward_rows(std::vector<SequenceState*>(seqs.begin() + long(i), seqs.begin() + long(i + n)),
                               std::vector<int32_t>(tokens.begin() + long(i), tokens.begin() + long(i + n)));
    for (auto& row : part) out.push_back(std::move(row));
  }
  return out;
}

int64_t CudaEngine::num_layers() const { return impl_->c.num_layers; }
int64_t CudaEngine::layer_begin() const { return impl_->layer_begin; }
int64_t CudaEngine::layer_end() const { return impl_->layer_end; }
int64_t CudaEngine::stream_width() const { return impl_->c.stream_width(); }

namespace {

// Layers [begin, end) for S tokens whose residual is in s.x; leaves the residual (pending output folded in) in s.x.
void run_stage_layers(CudaEngine::Impl& m, int64_t S, int64_t begin, int64_t end) {
  CudaBlocks blocks(m, S);
  run_decoder_layers(m.c, blocks, begin, end);
  blocks.flush(m.layers[size_t(end - 1)].post_norm);
}

// Pinned staging for the hand-off of one pass (rows x stream_width floats), allocated on first use.
float* stage_staging(CudaEngine::Impl& m) {
  if (!m.h_stage.as<void>()) m.h_stage = PinnedBuffer(size_t(m.rows * m.c.stream_width()) * 4);
  return m.h_stage.as<float>();
}

}  // namespace

void CudaEngine::embed(const std::vector<int32_t>& tokens, StageActivations& a) {
  Impl& m = *impl_;
  const Impl::DeviceLock lock(*m.device_mu);
  const DeviceGuard on(m.opt.device);
  if (m.layer_begin != 0)
    fail("embed: this engine holds layers [{}, {}); the embedding is the first stage's", m.layer_begin, m.layer_end);
  const int64_t S = int64_t(tokens.size()), W = m.c.stream_width(), V = m.c.vocab_size;
  if (S == 0 || S != a.tokens) fail("embed: {} tokens for activations of {}", S, a.tokens);
  m.pass_mode(Impl::kWholeSet);  // the pipeline entry points chunk by `rows`
  for (int32_t t : tokens)
    if (t < 0 || t >= V) fail("token id {} outside vocabulary [0, {})", t, V);
  a.hidden.resize(size_t(S * W));
  float* staged = stage_staging(m);
  for (int64_t c0 = 0; c0 < S; c0 += m.rows) {
    const int64_t n = std::min(m.rows, S - c0);
    MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));  // pinned staging is free again
    std::memcpy(m.h_tokens.as<int32_t>(), tokens.data() + c0, size_t(n) * 4);
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(m.d_tokens.as<void>(), m.h_tokens.as<void>(), size_t(n) * 4, cudaMemcpyHostToDevice, m.stream));
    CudaBlocks(m, n).embed();
    MOESRV_CUDA_OK(cudaMemcpyAsync(staged, m.s.x.as<void>(), size_t(n * W) * 4, cudaMemcpyDeviceToHost, m.stream));
    MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));
    std::memcpy(a.hidden.data() + c0 * W, staged, size_t(n * W) * 4);
  }
}

void CudaEngine::forward_layers(SequenceState& seq_base, StageActivations& a, int64_t begin, int64_t end) {
  Impl& m = *impl_;
  const Impl::DeviceLock lock(*m.device_mu);
  const DeviceGuard on(m.opt.device);
  CudaSequence* seq = &own_sequence(m, seq_base, "forward_layers");
  if (begin < m.layer_begin || end > m.layer_end || begin >= end)
    fail("forward_layers: layers [{}, {}) outside this engine's [{}, {})", begin, end, m.layer_begin, m.layer_end);
  const int64_t S = a.tokens, W = m.c.stream_width(), pos0 = a.pos0;
  if (S <= 0) fail("forward_layers: no tokens");
  if (seq->length() != pos0) fail("pipeline stage: sequence holds {} tokens, batch starts at {}", seq->length(), pos0);
  if (pos0 + S > m.max_ctx) fail("context length exceeded: {} + {} tokens > {}", pos0, S, m.max_ctx);
  if (int64_t(a.hidden.size()) != S * W) fail("pipeline stage: hidden state size mismatch");
  m.pass_mode(Impl::kWholeSet);
  // The DSA selection crosses the hand-off as host lists: packed into s.sel when a shared layer comes before any
  // indexer of the range, read back when the range runs an indexer (s.sel then holds the last one's).
  int64_t reader = -1;
  bool writes = false;
  for (int64_t l = begin; l < end; ++l) {
    const LayerSpec& L = m.c.layers[size_t(l)];
    if (L.indexer == IndexerKind::Own) writes = true;
    else if (L.indexer == IndexerKind::Shared && !writes && reader < 0) reader = l;
  }
  if (reader >= 0 && int64_t(a.selection.size()) != S)
    fail("forward_layers: layer {} reuses the DSA selection of layer {}, which the activations do not carry", reader,
         m.c.layers[size_t(reader)].indexer_from);
  if (writes) a.selection.resize(size_t(S));
  const int64_t Wsel = m.sel_width();
  if ((reader >= 0 || writes) && !m.h_stage_sel.as<void>()) m.h_stage_sel = PinnedBuffer(size_t(m.rows * Wsel) * 4);
  float* staged = stage_staging(m);
  // A decode graph holds the engine's whole range.
  const bool whole_range = begin == m.layer_begin && end == m.layer_end;
  MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));  // pinned staging is free again
  seq->begin_forward(0);
  bind_sequence(m, *seq);
  for_each_pass(m.pass_policy(), *seq, pos0, S, false, [&](const Pass& p) {
    const int64_t n = p.rows, c0 = p.offset;
    MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));
    *m.h_pos0.as<int32_t>() = int32_t(p.pos0);
    MOESRV_CUDA_OK(cudaMemcpyAsync(m.d_pos0.as<void>(), m.h_pos0.as<void>(), 4, cudaMemcpyHostToDevice, m.stream));
    std::memcpy(staged, a.hidden.data() + c0 * W, size_t(n * W) * 4);
    MOESRV_CUDA_OK(cudaMemcpyAsync(m.s.x.as<void>(), staged, size_t(n * W) * 4, cudaMemcpyHostToDevice, m.stream));
    if (reader >= 0) {
      pack_selection(a.selection, c0, n, Wsel, m.h_stage_sel.as<int32_t>());
      MOESRV_CUDA_OK(cudaMemcpyAsync(m.s.sel.as<void>(), m.h_stage_sel.as<void>(), size_t(n * Wsel) * 4,
                                     cudaMemcpyHostToDevice, m.stream));
    }
    if (n == 1 && whole_range && m.graph_ok()) {
      // As forward(): one graph of the stage's layers, per sequence for models with fixed-size state.
      cudaGraphExec_t& graph =
          seq->has_fixed_state() ? m.sequence_graphs->get(seq->id | Impl::kStageGraph) : m.stage_graph;
      m.replay(graph, [&] { run_stage_layers(m, 1, begin, end); });
    } else {
      run_stage_layers(m, n, begin, end);
    }
    MOESRV_CUDA_OK(cudaMemcpyAsync(staged, m.s.x.as<void>(), size_t(n * W) * 4, cudaMemcpyDeviceToHost, m.stream));
    if (writes)
      MOESRV_CUDA_OK(cudaMemcpyAsync(m.h_stage_sel.as<void>(), m.s.sel.as<void>(), size_t(n * Wsel) * 4,
                                     cudaMemcpyDeviceToHost, m.stream));
    MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));
    std::memcpy(a.hidden.data() + c0 * W, staged, size_t(n * W) * 4);
    if (writes) unpack_selection(m.h_stage_sel.as<int32_t>(), n, Wsel, c0, a.selection);
  });
  MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));
}

std::vector<float> CudaEngine::logits(const StageActivations& a, int64_t rows) {
  Impl& m = *impl_;
  const Impl::DeviceLock lock(*m.device_mu);
  const DeviceGuard on(m.opt.device);
  if (m.layer_end != m.c.num_layers)
    fail("logits: this engine holds layers [{}, {}); the final norm and lm_head are the last stage's", m.layer_begin,
         m.layer_end);
  const int64_t S = a.tokens, W = m.c.stream_width(), V = m.c.vocab_size;
  if (rows < 1 || rows > S) fail("logits: {} rows of {} tokens", rows, S);
  m.pass_mode(Impl::kWholeSet);
  if (int64_t(a.hidden.size()) != S * W) fail("pipeline stage: hidden state size mismatch");
  std::vector<float> out(size_t(rows * V));
  float* staged = stage_staging(m);
  for (int64_t r0 = 0; r0 < rows; r0 += m.rows) {
    const int64_t n = std::min(m.rows, rows - r0);
    MOESRV_CUDA_OK(cudaStreamSynchronize(m.stream));
    std::memcpy(staged, a.hidden.data() + (S - rows + r0) * W, size_t(n * W) * 4);
    MOESRV_CUDA_OK(cudaMemcpyAsync(m.s.x.as<void>(), staged, size_t(n * W) * 4, cudaMemcpyHostToDevice, m.stream));
    CudaBlocks(m, n).final_norm(m.final_norm);
    m.lm_head_rows(0, n, out.data() + r0 * V);
  }
  return out;
}

std::unique_ptr<Engine> make_cuda_engine(std::shared_ptr<ModelPackage> pkg, const CudaEngineOptions& opt) {
  return std::make_unique<CudaEngine>(std::move(pkg), opt);
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
