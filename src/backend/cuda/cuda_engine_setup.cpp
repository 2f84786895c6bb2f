// CUDA engine setup: weight upload (bf16, or EXL3 as stored), expert placement planning, scratch.
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "backend/cpu/linear.h"
#include "backend/cuda/engine_internal.h"
#include "model/rope.h"
#include "model/state.h"

namespace moesrv {

using namespace moesrv::cuda;

namespace {

constexpr int64_t kSliceFloats = int64_t(64) << 20;  // the largest per-slice scratch (attention, DSA, logits rows)

template <typename T>
DeviceBuffer upload(const std::shared_ptr<DeviceBudget>& b, const std::vector<T>& v, const char* what) {
  DeviceBuffer d(b, v.size() * sizeof(T), what);
  MOESRV_CUDA_OK(cudaMemcpy(d.as<void>(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<uint16_t> to_bf16_vec(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16_host(v[i]);
  return o;
}

// Block bytes and EXL3 layout of each routed expert (uploaded after planning).
void layout_experts(const MoeWeights& hw, DevMoe& m) {
  const size_t E = hw.experts.size();
  m.exl3 = exl3_experts(hw);
  m.block_bytes.assign(E, 0);
  m.x3_off.assign(E, {});
  for (size_t e = 0; e < E; ++e) m.block_bytes[e] = expert_block(hw.experts[e], m.exl3, &m.x3_off[e], nullptr);
  m.x3_grouped = m.exl3;
  for (size_t e = 1; e < E && m.x3_grouped; ++e)
    for (int p = 0; p < 3; ++p) {
      const Exl3Dev &a = m.x3_off[0][size_t(p)], &b = m.x3_off[e][size_t(p)];
      m.x3_grouped &= a.K == b.K && a.cb == b.cb && a.in_pad == b.in_pad && a.out_pad == b.out_pad && a.in == b.in &&
                      a.out == b.out;
    }
}

// A side stream with its fork and join events (HyperSide), made and released.
void open_side(HyperSide& side) {
  MOESRV_CUDA_OK(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking));
  MOESRV_CUDA_OK(cudaEventCreateWithFlags(&side.fork, cudaEventDisableTiming));
  MOESRV_CUDA_OK(cudaEventCreateWithFlags(&side.join, cudaEventDisableTiming));
}
void close_side(const HyperSide& side) {
  if (side.fork) cudaEventDestroy(side.fork);
  if (side.join) cudaEventDestroy(side.join);
  if (side.stream) cudaStreamDestroy(side.stream);
}

}  // namespace

CudaEngine::Impl::Impl(std::shared_ptr<ModelPackage> pkg, const CudaEngineOptions& o)
    : opt(o),
      weights(o.spec ? ModelWeights::load(pkg, *o.spec, load_linear) : ModelWeights::load(pkg, load_linear)),
      c(weights->config),
      name(o.served_name),
      use_graph(o.use_graph) {
  if (name.empty()) name = pkg->dir().substr(pkg->dir().find_last_of('/') + 1);
  MOESRV_CUDA_OK(cudaSetDevice(opt.device));
  size_t free_b = 0, total_b = 0;
  MOESRV_CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  size_t limit = opt.vram_budget_gib > 0 ? size_t(opt.vram_budget_gib * double(1ull << 30)) : free_b - std::min<size_t>(free_b, 512ull << 20);
  budget = std::make_shared<DeviceBudget>(limit, opt.device);
  up.budget = budget;
  open_device();
  if (c.has_recurrent_layers() && !cuda_delta_rule_supports(c.linear.dk))
    fail("CUDA engine: linear-attention key heads of {} values are not supported (32, 64, 96, 128, 192, 256)",
         c.linear.dk);
  set_geometry();

  upload_weights();
  allocate_scratch();
  allocate_exl3_scratch();
  // The MTP block's dense weights and scratch before the experts are placed (its caches are reserved with the
  // model's), its experts after the model's.
  if (opt.mtp && weights->mtp_block && layer_begin == 0 && layer_end == c.num_layers)
    mtp = std::make_unique<Impl>(*this, MtpTag{});
  const size_t reserve = (seq_bytes + (mtp ? mtp->seq_bytes : 0)) * size_t(std::max<int64_t>(0, opt.reserve_sequences));
  allocate_hybrid_lanes(reserve);
  plan_experts(reserve);
  allocate_expert_lanes(reserve);
  if (mtp) mtp->plan_experts(0);
  stats.vram_budget = budget->limit();
}

void CudaEngine::Impl::open_device() {
  MOESRV_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  MOESRV_CUDA_OK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  MOESRV_CUDA_OK(cudaEventCreateWithFlags(&routing_copied, cudaEventDisableTiming));
  for (HyperSide* side : {&mhc_side, &proj_side}) open_side(*side);
  MOESRV_CUBLAS_OK(cublasCreate(&cublas));
  MOESRV_CUBLAS_OK(cublasSetStream(cublas, stream));
  cublas_workspace = DeviceBuffer(budget, 32ull << 20, "cuBLAS workspace");
  MOESRV_CUBLAS_OK(cublasSetWorkspace(cublas, cublas_workspace.as<void>(), cublas_workspace.bytes()));
}

void CudaEngine::Impl::set_geometry() {
  layer_begin = opt.layer_begin;
  layer_end = opt.layer_end < 0 ? c.num_layers : opt.layer_end;
  if (layer_begin < 0 || layer_end > c.num_layers || layer_begin >= layer_end)
    fail("CUDA engine: layer range [{}, {}) outside the model's {} layers", layer_begin, layer_end, c.num_layers);
  max_ctx = opt.max_ctx > 0 ? std::min(opt.max_ctx, c.max_position) : std::min<int64_t>(c.max_position, 32768);
  rows = std::max<int64_t>(1, std::min(opt.prefill_chunk, max_ctx));
  // Prefill groups: whole-model engines only (a pipeline stage's forward_layers and the MTP block run pass by pass).
  group_passes = opt.prefill_group;
  if (const char* v = std::getenv("MOESRV_PREFILL_GROUP"); v && !model) group_passes = std::atoll(v);
  if (model || layer_begin != 0 || layer_end != c.num_layers) group_passes = 1;
  // At most the context, and rows that per-token kernels can put in a grid's y or z dimension (65535).
  group_passes = std::clamp<int64_t>(
      group_passes, 1, std::max<int64_t>(1, std::min((max_ctx + rows - 1) / rows, int64_t(65535) / rows)));
  const int64_t elem = opt.kv_q8 ? 1 : 2;
  if (c.attention == AttentionKind::MLA) {
    kv_row = c.kv_lora_rank + c.qk_rope_dim;
    v_row = 0;
  } else {
    kv_row = v_row = c.num_kv_heads * c.head_dim;
  }
  // model/state.h's formula: bf16 (or int8 with per-token fp32 scales) KV, bf16 DSA keys, fp32 pooled k-pool keys
  // and fixed state.
  seq_bytes = size_t(state_bytes(c, max_ctx, int(elem), 4, layer_begin, layer_end, c.index_kpool > 1 ? 4 : 2));
  // A sequence's checkpoints of its fixed-size state (the formula at 0 tokens) live in VRAM too, and with the MTP
  // block loaded so do a verify's rollback points (CudaSequence::begin_forward).
  const int64_t copies = kMaxCheckpoints + (opt.mtp ? kMaxRollbackRows - 1 : 0);
  seq_bytes += size_t(copies) * size_t(state_bytes(c, 0, int(elem), 4, layer_begin, layer_end, 4));
}

CudaEngine::Impl::~Impl() {
  cudaSetDevice(opt.device);  // a pipeline's engines live on several devices
  if (stream) cudaStreamSynchronize(stream);
  for (cudaGraphExec_t g : graphs)
    if (g) cudaGraphExecDestroy(g);
  if (stage_graph) cudaGraphExecDestroy(stage_graph);
  sequence_graphs->clear();
  for (auto& L : layers)
    if (L.moe)
      for (auto& s : L.moe->slots) {
        if (s.ready) cudaEventDestroy(s.ready);
        if (s.free) cudaEventDestroy(s.free);
      }
  if (cublas) cublasDestroy(cublas);
  if (copy_stream) cudaStreamDestroy(copy_stream);
  for (HyperSide* side : {&mhc_side, &proj_side}) close_side(*side);
  for (ExpertLane& lane : expert_lanes) {
    if (lane.stream) cudaStreamSynchronize(lane.stream);
    if (lane.blas) cublasDestroy(lane.blas);
    if (lane.join) cudaEventDestroy(lane.join);
    if (lane.stream) cudaStreamDestroy(lane.stream);
  }
  if (lanes_fork) cudaEventDestroy(lanes_fork);
  if (routing_copied) cudaEventDestroy(routing_copied);
  if (stream) cudaStreamDestroy(stream);
}

void CudaEngine::Impl::upload_weights() {
  const ModelWeights& W = *weights;
  if (model) {  // the MTP block's engine: the model's embedding
    embed = DeviceBuffer::view(model->embed.as<void>(), model->embed.bytes());
  } else if (layer_begin == 0) {  // the first stage's
    std::vector<float> tmp;
    std::vector<uint16_t> e;
    const int64_t D = c.hidden_size, block = 4096;
    e.reserve(size_t(c.vocab_size * D));
    for (int64_t r = 0; r < c.vocab_size; r += block) {
      const int64_t n = std::min(block, c.vocab_size - r);
      tmp.resize(size_t(n * D));
      W.embed->rows_to_f32(r, r + n, tmp.data());
      for (float v : tmp) e.push_back(f32_to_bf16_host(v));
    }
    static const bool host_env = switch_on("MOESRV_HOST_EMBED");
    if (hybrid_options() && opt.host_embedding && host_env) {  // (read in place by embed_gather)
      try {
        embed_host = PinnedBuffer(e.size() * 2, true);
      } catch (const Error& err) {  // no page-locked memory to spare: the table goes to VRAM as without a budget
        std::fprintf(stderr, "moesrv: embedding table kept in VRAM (%s)\n", err.what());
      }
    }
    if (embed_host.bytes()) {
      std::copy(e.begin(), e.end(), embed_host.as<uint16_t>());
      embed = DeviceBuffer::view(embed_host.device(), embed_host.bytes());
      stats.host_embedding_bytes = embed_host.bytes();
    } else {
      embed = up.vec(e, "embedding");
    }
  }
  // cos/sin per position with the attention factor, computed exactly like Rope::apply.
  if (model) {
    cos_sin = DeviceBuffer::view(model->cos_sin.as<void>(), model->cos_sin.bytes());
  } else {
    const int64_t half = c.rope.dim / 2;
    const Rope table(c.rope);
    std::vector<float> cs(size_t(max_ctx * half * 2));
    const float af = float(c.rope.attention_factor);
    for (int64_t p = 0; p < max_ctx; ++p)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = float(p) * table.inv_freq()[size_t(i)];
        cs[size_t((p * half + i) * 2)] = std::cos(angle) * af;
        cs[size_t((p * half + i) * 2 + 1)] = std::sin(angle) * af;
      }
    if (cs.empty()) cs.push_back(0.0f);
    cos_sin = upload(budget, cs, "rope table");
  }
  if (layer_end == c.num_layers) {  // the last stage's
    final_norm = up.norm(W.final_norm);
    if (model && !W.lm_head) lm_head = view_of(model->lm_head);  // the MTP block without a head of its own
    else lm_head = up.linear({W.lm_head.get()}, "lm_head");
  }
  layers.resize(size_t(c.num_layers));  // indexed by model layer; only [layer_begin, layer_end) uploaded
  for (int64_t l = layer_begin; l < layer_end; ++l) {
    const LayerWeights& L = W.layers[size_t(l)];
    DevLayer& d = layers[size_t(l)];
    d.input_norm = up.norm(L.input_norm);
    d.post_norm = up.norm(L.post_attention_norm);
    DevAttention& a = d.attn;
    if (c.residual.hyper) {
      d.attn_hc = {up.vec(L.attn_hc.fn, "mHC fn"), up.vec(L.attn_hc.base, "mHC base"),
                   up.vec(L.attn_hc.scale, "mHC scale")};
      d.ffn_hc = {up.vec(L.ffn_hc.fn, "mHC fn"), up.vec(L.ffn_hc.base, "mHC base"),
                  up.vec(L.ffn_hc.scale, "mHC scale")};
    }
    if (L.kda) {
      const KdaWeights& k = *L.kda;
      DevKda x;
      x.qkv = up.linear({k.q.get(), k.k.get(), k.v.get()}, "KDA q/k/v");
      x.f_a = up.linear({k.f_a.get()}, "KDA f_a");
      x.f_b = up.linear({k.f_b.get()}, "KDA f_b");
      x.b = up.linear({k.b.get()}, "KDA b");
      x.g_a = up.linear({k.g_a.get()}, "KDA g_a");
      x.g_b = up.linear({k.g_b.get()}, "KDA g_b");
      x.o = up.linear({k.o.get()}, "KDA o_proj");
      x.fg_a = up.pair(x.f_a, x.g_a);
      x.fg_b = up.pair(x.f_b, x.g_b);
      x.conv = up.vec(k.conv, "KDA conv");
      x.dt_bias = up.vec(k.dt_bias, "KDA dt_bias");
      x.a_log = up.vec(k.a_log, "KDA A_log");
      x.o_norm = up.norm(k.o_norm);
      d.kda = std::move(x);
    } else if (L.gated_delta) {
      const GatedDeltaWeights& g = *L.gated_delta;
      DevGatedDelta x;
      x.qkvz = up.linear({g.qkvz.get()}, "Gated DeltaNet in_proj_qkvz");
      x.ba = up.linear({g.ba.get()}, "Gated DeltaNet in_proj_ba");
      x.out = up.linear({g.out.get()}, "Gated DeltaNet out_proj");
      x.conv = up.vec(g.conv, "Gated DeltaNet conv");
      x.dt_bias = up.vec(g.dt_bias, "Gated DeltaNet dt_bias");
      x.a_log = up.vec(g.a_log, "Gated DeltaNet A_log");
      x.norm = up.norm(g.norm);
      d.gated_delta = std::move(x);
    } else if (L.mla) {
      const MlaWeights& m = *L.mla;
      if (m.q_a) {
        a.q_a = up.linear({m.q_a.get()}, "q_a_proj");
        a.q_b = up.linear({m.q_b.get()}, "q_b_proj");
        a.q_a_norm = up.norm(m.q_a_norm);
      } else {
        a.q = up.linear({m.q.get()}, "q_proj");
      }
      a.kv_a = up.linear({m.kv_a.get()}, "kv_a_proj");
      a.kv_a_norm = up.norm(m.kv_a_norm);
      a.o = up.linear({m.o.get()}, "o_proj");
      a.w_uk = up.vec(to_bf16_vec(m.w_uk), "w_uk");
      a.w_uv = up.vec(to_bf16_vec(m.w_uv), "w_uv");
      if (m.indexer) {
        DevIndexer ix;
        ix.wq_b = up.linear({m.indexer->wq_b.get()}, "indexer wq_b");
        ix.wk = up.linear({m.indexer->wk.get()}, "indexer wk");
        ix.weights_proj = up.linear({m.indexer->weights_proj.get()}, "indexer weights_proj");
        ix.k_norm = up.norm(m.indexer->k_norm);
        if (m.indexer->pool_gate) {
          ix.pool_gate = up.linear({m.indexer->pool_gate.get()}, "indexer pool gate");
          ix.pool_ape = up.vec(m.indexer->pool_ape, "indexer pool ape");
        }
        a.indexer = std::move(ix);
      }
    } else {
      const GqaWeights& g = *L.gqa;
      a.gq = up.linear({g.q.get()}, "q_proj");
      a.gk = up.linear({g.k.get()}, "k_proj");
      a.gv = up.linear({g.v.get()}, "v_proj");
      a.o = up.linear({g.o.get()}, "o_proj");
      if (c.qk_norm) {
        a.q_norm = up.norm(g.q_norm);
        a.k_norm = up.norm(g.k_norm);
      }
    }
    if (L.mlp) d.mlp = up.mlp(*L.mlp, "mlp");
    if (L.moe) {
      DevMoe m;
      m.router = up.vec(L.moe->router, "router");
      m.router_bias = up.vec(L.moe->router_bias, "router bias");
      if (L.moe->shared) m.shared = up.mlp(*L.moe->shared, "shared expert");
      if (!L.moe->shared_gate.empty()) m.shared_gate = up.vec(L.moe->shared_gate, "shared expert gate");
      m.limit = L.moe->experts.empty() ? 0.0f : L.moe->experts[0].limit;
      layout_experts(*L.moe, m);
      d.moe = std::move(m);
    }
  }
}

// Layer l's experts as the planning arithmetic sees them (backend/expert_plan.h), placed as `placement` says.
ExpertLayer CudaEngine::Impl::expert_layer(int64_t l, std::vector<ExpertPlacement> placement) const {
  const DevMoe& m = *layers[size_t(l)].moe;
  int64_t wanted = opt.cache_slots;
  if (size_t(l) < opt.cache_slots_per_layer.size() && opt.cache_slots_per_layer[size_t(l)] > 0)
    wanted = opt.cache_slots_per_layer[size_t(l)];
  // Only EXL3 experts stream: they are copied from the host weights as stored; a bf16 layer would need a second
  // (pinned, converted) host copy of every CPU expert.
  return {m.block_bytes, std::move(placement), m.exl3 && opt.stream_cold, wanted};
}

// Every MoE layer with the caller's placement where it gives one (else empty: placed by fill_in_order).
std::vector<ExpertLayer> CudaEngine::Impl::given_expert_layers() const {
  const int64_t E = c.n_routed_experts;
  if (!opt.placement.empty() && int64_t(opt.placement.size()) != c.num_layers)
    fail("placement has {} layers, the model {}", opt.placement.size(), c.num_layers);
  std::vector<ExpertLayer> out(size_t(c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!layers[size_t(l)].moe) continue;
    std::vector<ExpertPlacement> given =
        opt.placement.empty() ? std::vector<ExpertPlacement>{} : opt.placement[size_t(l)];
    if (!given.empty() && int64_t(given.size()) != E)
      fail("placement of layer {} has {} experts, the model {}", l, given.size(), E);
    out[size_t(l)] = expert_layer(l, std::move(given));
  }
  return out;
}

// Places routed experts (backend/expert_plan.h): the caller's placement where given (or set by opt.plan_placement,
// the runtime planner, once the engine's own memory is known), fitted to the budget; else VRAM in order while the
// budget, less `reserve_bytes` for KV caches, allows, and the CPU after that. Then uploads them.
void CudaEngine::Impl::plan_experts(size_t reserve_bytes) {
  const int64_t E = c.n_routed_experts;
  const size_t planned = budget->used() + reserve_bytes;
  if (opt.plan_placement) opt.plan_placement(planned, budget->limit(), opt);
  std::vector<ExpertLayer> moe = given_expert_layers();
  stats.placement_moved = place_experts(moe, planned, budget->limit(), !opt.placement.empty());
  if (stats.placement_moved > 0)
    fmt::print(stderr,
               "placement: {} VRAM experts moved to host memory to fit the {:.2f} GiB budget (the plan left too "
               "little room for the engine's activations and scratch)\n",
               stats.placement_moved, double(budget->limit()) / double(1ull << 30));
  placement.assign(size_t(c.num_layers), {});
  for (int64_t l = 0; l < c.num_layers; ++l) placement[size_t(l)] = std::move(moe[size_t(l)].placement);
  if (lending) {  // the pass arena in equal shares to the MoE layers with experts outside VRAM
    int64_t cold_layers = 0;
    for (int64_t l = 0; l < c.num_layers; ++l)
      cold_layers += layers[size_t(l)].moe && std::any_of(placement[size_t(l)].begin(), placement[size_t(l)].end(),
                                                          [](ExpertPlacement p) { return p != ExpertPlacement::Vram; });
    const int64_t shares = std::max<int64_t>(cold_layers, opt.lend_share_layers);
    lend_each = shares ? lend_bytes / size_t(shares) : 0;
  }
  std::vector<int32_t> slots(size_t(c.num_layers), 0), lent(size_t(c.num_layers), 0);
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (layers[size_t(l)].moe) {
      upload_moe(l);
      const DevMoe& m = *layers[size_t(l)].moe;
      slots[size_t(l)] = int32_t(m.slots.size());
      lent[size_t(l)] = int32_t(int64_t(m.slots.size()) - m.lent_from);
    }
  host_registration->commit();  // page-lock the host expert weights the slots are filled from
  map_host_experts();
  measure_cold_rates();
  expert_cache = std::make_unique<ExpertCache>(slots, int32_t(std::max<int64_t>(1, E)), lent);
  const char* window = std::getenv("MOESRV_CACHE_VICTIM_WINDOW");
  expert_cache->set_victim_window(std::max(1, window && window[0] ? std::atoi(window) : opt.cache_victim_window));
  if (!pass_big)
    for (int64_t l = 0; l < c.num_layers; ++l) expert_cache->lend(int32_t(l));
  prefetch_limit = opt.prefetch_experts;
  if (const char* v = std::getenv("MOESRV_PREFETCH_EXPERTS")) prefetch_limit = std::atoll(v);
  prefetch_limit = std::clamp<int64_t>(prefetch_limit, 0, E);
  prefetched.assign(size_t(c.num_layers), std::vector<uint8_t>(size_t(E), 0));
}

// zero_copy_cold: each candidate layer's host experts as mapped parts in its expert table, when all of them can be.
void CudaEngine::Impl::map_host_experts() {
  const int64_t E = c.n_routed_experts;
  int64_t refused = 0;
  for (DevLayer& L : layers) {
    if (!L.moe || L.moe->x3_tab_host.empty()) continue;
    DevMoe& m = *L.moe;
    std::vector<Exl3Dev> tab = std::move(m.x3_tab_host);
    m.x3_tab_host.clear();
    bool ok = true;
    for (int64_t e = 0; e < E && ok; ++e) {
      if (m.placement[size_t(e)] == ExpertPlacement::Vram) continue;
      std::array<Exl3Dev, 3> parts;
      ok = m.host->mapped_parts(int(e), parts);
      for (int j = 0; j < 3 && ok; ++j) tab[size_t(j * m.x3_stride + e)] = parts[size_t(j)];
    }
    if (!ok) {
      ++refused;
      continue;
    }
    m.x3_tab = upload(budget, tab, "expert table");
    m.zero_copy = true;
    ++stats.zero_copy_layers;
  }
  if (refused)
    std::fprintf(stderr, "moesrv: %ld MoE layers keep copying their host experts (not readable in place)\n",
                 long(refused));
}

void CudaEngine::Impl::upload_moe(int64_t l) {
  DevMoe& m = *layers[size_t(l)].moe;
  const MoeWeights& hw = *weights->layers[size_t(l)].moe;
  const int64_t E = c.n_routed_experts, D = c.hidden_size, I = c.moe_intermediate_size;
  m.placement = placement[size_t(l)];
  m.vram.resize(size_t(E));
  m.h_gate_up.assign(size_t(E), nullptr);
  m.h_down.assign(size_t(E), nullptr);
  // The shared expert joins the grouped launches when its projections have the routed experts' shapes and codes.
  m.shared_grouped = m.exl3 && m.x3_grouped && m.shared && !m.shared_gate.bytes() && m.shared->limit == m.limit &&
                     m.shared->gate_up.x3.size() == 2 && m.shared->down.x3.size() == 1;
  const Exl3Dev* shared_parts[3] = {nullptr, nullptr, nullptr};
  if (m.shared_grouped) {
    shared_parts[0] = &m.shared->gate_up.x3[0].w, shared_parts[1] = &m.shared->gate_up.x3[1].w;
    shared_parts[2] = &m.shared->down.x3[0].w;
    for (int j = 0; j < 3; ++j) {
      const Exl3Dev &a = m.x3_off[0][size_t(j)], &b = *shared_parts[j];
      m.shared_grouped &= a.K == b.K && a.cb == b.cb && a.in_pad == b.in_pad && a.out_pad == b.out_pad &&
                          a.in == b.in && a.out == b.out;
    }
  }
  m.x3_stride = E + (m.shared_grouped ? 1 : 0);
  std::vector<Exl3Dev> tab(m.exl3 ? size_t(3 * m.x3_stride) : 0);  // [projection][expert (+ shared)]
  if (m.shared_grouped)
    for (int j = 0; j < 3; ++j) tab[size_t(j * m.x3_stride + E)] = *shared_parts[j];
  const ExpertLayer experts = expert_layer(l, m.placement);
  const SlotUse use = experts.slot_use();
  const int64_t slotted = use.cached + use.streamable;
  std::vector<bool> host(size_t(E), false);  // experts a slot may be filled from host memory with
  for (int64_t e = 0; e < E; ++e) {
    const ExpertPlacement p = m.placement[size_t(e)];
    m.all_vram &= p == ExpertPlacement::Vram;
    if (p != ExpertPlacement::Vram) {
      host[size_t(e)] = experts.uses_slots(size_t(e));
      continue;
    }
    std::vector<uint8_t> block;
    std::array<Exl3Dev, 3> off;
    expert_block(hw.experts[size_t(e)], m.exl3, &off, &block);
    DeviceBuffer& d = m.vram[size_t(e)] = up.raw(block.data(), block.size(), "routed expert");
    if (m.exl3) {
      up.exl3_bytes += block.size();
      for (int j = 0; j < 3; ++j) tab[size_t(j * m.x3_stride + e)] = rebase(off[size_t(j)], d.as<void>());
    } else {
      m.h_gate_up[size_t(e)] = d.as<uint16_t>();
      m.h_down[size_t(e)] = m.h_gate_up[size_t(e)] + 2 * I * D;
    }
  }
  // zero_copy_cold: a grouped EXL3 layer whose experts outside VRAM all have host copies reads those in place.
  static const bool zero_copy_env = switch_set("MOESRV_ZERO_COPY");
  bool every_host = slotted > 0;
  for (int64_t e = 0; e < E; ++e) every_host &= m.placement[size_t(e)] == ExpertPlacement::Vram || host[size_t(e)];
  const bool zero_copy = (opt.zero_copy_cold || zero_copy_env) && m.exl3 && m.x3_grouped && every_host;
  host_registration->mapped |= zero_copy;
  if (slotted > 0) m.host = std::make_unique<HostExperts>(hw, m.exl3, m.x3_off, host, *host_registration, zero_copy);
  if (!m.exl3) {
    m.gate_up_ptrs = upload(budget, m.h_gate_up, "expert pointer table");
    m.down_ptrs = upload(budget, m.h_down, "expert pointer table");
  }
  for (int64_t i = 0; i < use.slots; ++i) add_slot(m, DeviceBuffer(budget, use.slot_bytes, "expert cache slot"));
  lend_slots(l, zero_copy ? 0 : slotted - use.slots, use.slot_bytes);
  if (!m.exl3 || !m.x3_grouped) return;
  // Slot entries: where every host expert's block has one layout (x3_off), entry x3_slot_base + i of each
  // projection is slot i's copy of it, whichever expert the slot holds, so a host-planned decode pass runs its slot
  // experts in the grouped launches too (moe_exl3_sorted_rows).
  bool uniform = !m.slots.empty();
  int64_t first = -1;
  for (int64_t e = 0; e < E && uniform; ++e) {
    if (!host[size_t(e)]) continue;
    if (first < 0) first = e;
    for (int j = 0; j < 3; ++j) {
      const Exl3Dev &a = m.x3_off[size_t(first)][size_t(j)], &b = m.x3_off[size_t(e)][size_t(j)];
      uniform &= a.trellis == b.trellis && a.suh == b.suh && a.svh == b.svh && a.K == b.K && a.cb == b.cb &&
                 a.in_pad == b.in_pad && a.out_pad == b.out_pad && a.in == b.in && a.out == b.out;
    }
  }
  if (uniform && first >= 0) {
    const int64_t stride = m.x3_stride + int64_t(m.slots.size());
    std::vector<Exl3Dev> wide(size_t(3 * stride));
    for (int j = 0; j < 3; ++j) {
      std::copy_n(tab.begin() + j * m.x3_stride, m.x3_stride, wide.begin() + j * stride);
      for (size_t i = 0; i < m.slots.size(); ++i)
        wide[size_t(j * stride + m.x3_stride) + i] =
            rebase(m.x3_off[size_t(first)][size_t(j)], m.slots[i].mem.as<void>());
    }
    m.x3_slot_base = m.x3_stride;
    m.x3_stride = stride;
    tab = std::move(wide);
  }
  m.x3_tab = upload(budget, tab, "expert table");
  if (zero_copy) m.x3_tab_host = tab;
}

// The buffers a pass of R tokens (a group of RG) writes and reads only while it runs, as views of one arena: the
// residual streams, hidden rows, bf16 inputs and dense MLP rows, then the mixers' buffers. A layer runs its attention
// (MLA / GQA, with the indexer's scratch) or its linear attention (KDA / Gated DeltaNet), never both, so those two
// groups share the same bytes (GLM-5.3-Flash at 8K-token passes: ~2.2 GB of attention and ~2.4 GB of linear-attention
// buffers). pass_members lists the members set, in order.
void CudaEngine::Impl::make_pass_buffers(int64_t R, int64_t RG, Scratch& t, int64_t& t_attn_rows, int64_t& t_dsa_rows) {
  const int64_t D = c.hidden_size, H = c.num_heads;
  const LinearAttnDims& la = c.linear;
  int64_t max_in = std::max({D, c.intermediate_size, c.q_lora_rank, H * std::max(c.v_head_dim, c.head_dim),
                             c.kv_lora_rank, c.moe_intermediate_size * std::max<int64_t>(1, c.n_shared_experts),
                             c.shared_intermediate_size, la.v_heads * la.dv});
  if (mtp_in) max_in = std::max(max_in, 2 * D);  // the MTP block's eh_proj
  const int64_t inter =
      std::max({c.intermediate_size, c.moe_intermediate_size * std::max<int64_t>(1, c.n_shared_experts),
                c.shared_intermediate_size});
  using Member = DeviceBuffer Scratch::*;
  struct Group {
    std::vector<std::pair<Member, size_t>> parts;
    size_t bytes = 0;
    void add(Member b, int64_t floats) { add_bytes(b, size_t(std::max<int64_t>(floats, 1)) * 4); }
    void add_bytes(Member b, size_t n) {
      parts.push_back({b, n});
      bytes += (n + 255) / 256 * 256;  // views 256-byte aligned, as cudaMalloc's
    }
  } rows_group, attn, lin;
  rows_group.add(&Scratch::x, RG * c.stream_width());
  rows_group.add(&Scratch::h, RG * D);
  rows_group.add(&Scratch::y, RG * D);
  rows_group.add_bytes(&Scratch::xb, size_t(R * max_in) * 2);
  rows_group.add(&Scratch::gu, R * 2 * inter);
  rows_group.add(&Scratch::act, R * inter);
  if (c.attention == AttentionKind::MLA) {
    const int64_t lat = c.kv_lora_rank + c.qk_rope_dim;
    t_attn_rows = std::clamp<int64_t>(kSliceFloats / (H * lat), 1, R);
    if (opt.mla_split_decode)
      attn.add(&Scratch::mla_part,
               int64_t(mla_split_floats(int(std::min<int64_t>(R, kMlaSplitMaxTokens)), int(H), int(c.kv_lora_rank))));
    attn.add(&Scratch::q_lat, R * c.q_lora_rank);
    attn.add(&Scratch::q, R * H * c.qk_head_dim());
    attn.add(&Scratch::kv, R * lat);
    attn.add(&Scratch::qcat, t_attn_rows * H * lat);
    attn.add(&Scratch::olat, t_attn_rows * H * c.kv_lora_rank);
    // fp32 copy of one layer's W_uk or W_uv for the prefill absorption GEMMs
    attn.add(&Scratch::w_absorb, H * std::max(c.qk_nope_dim, c.v_head_dim) * c.kv_lora_rank);
    attn.add(&Scratch::attn_out, R * H * c.v_head_dim);
    if (c.dsa) {
      const int64_t keys = c.index_kpool > 1 ? max_pools() : max_ctx;  // scored per query
      t_dsa_rows = std::clamp<int64_t>(kSliceFloats / keys, 1, R);
      attn.add(&Scratch::iq, R * c.index_n_heads * c.index_head_dim);
      attn.add(&Scratch::ik, R * c.index_head_dim);
      attn.add(&Scratch::ihw, R * c.index_n_heads);
      if (c.index_kpool > 1) attn.add(&Scratch::ig, R * c.index_head_dim);
      // + what a decode row's split top-k needs besides its scores (kpool_select)
      const int64_t split = c.index_kpool > 1 ? int64_t(kpool_select_scratch(1, 0, int(c.index_topk / c.index_kpool))) *
                                                    std::min<int64_t>(R, 8)
                                              : 0;
      attn.add(&Scratch::dsa_scores, t_dsa_rows * keys + split);
    }
  } else if (c.attention == AttentionKind::GQA) {
    t_attn_rows = R;
    attn.add(&Scratch::q, R * H * c.head_dim);
    attn.add(&Scratch::k, R * c.num_kv_heads * c.head_dim);
    attn.add(&Scratch::v, R * c.num_kv_heads * c.head_dim);
    attn.add(&Scratch::attn_out, R * H * c.head_dim);
    if (c.attn_output_gate) attn.add(&Scratch::qgate, R * H * 2 * c.head_dim);
  }
  if (c.has_recurrent_layers()) {
    // KDA: q/k/v projection, conv output, decay, beta, out, low rank, gate. Gated DeltaNet: qkvz then the conv
    // output, the conv input q | k | v, decay, beta, out, ba, z.
    const bool gdn =
        std::any_of(c.layers.begin(), c.layers.end(), [](const LayerSpec& L) { return L.mixer == Mixer::GatedDelta; });
    const int64_t Hd = la.v_heads * std::max(la.dk, la.dv);
    lin.add(&Scratch::lraw, R * (la.conv_channels() + (gdn ? la.v_heads * la.dv : 0)));
    lin.add(&Scratch::lqkv, R * la.conv_channels());
    lin.add(&Scratch::lg, R * Hd);
    lin.add(&Scratch::lbeta, R * la.v_heads);
    lin.add(&Scratch::lo, R * Hd);
    lin.add(&Scratch::lfa, R * std::max(la.dk, 2 * la.v_heads));
    lin.add(&Scratch::lgate, R * Hd);
  }
  t.pass_arena =
      DeviceBuffer(budget, rows_group.bytes + std::max({attn.bytes, lin.bytes, size_t(256)}), "pass buffers");
  pass_members.assign(1, &Scratch::pass_arena);
  for (const Group* g : {&rows_group, &attn, &lin}) {
    size_t at = g == &rows_group ? 0 : rows_group.bytes;
    for (auto [member, n] : g->parts) {
      t.*member = DeviceBuffer::view(t.pass_arena.as<char>() + at, n);
      at += (n + 255) / 256 * 256;
      pass_members.push_back(member);
    }
  }
}

void CudaEngine::Impl::swap_pass_buffers() {
  for (DeviceBuffer Scratch::*member : pass_members) std::swap(s.*member, parked.*member);
  std::swap(attn_rows, parked_attn_rows);
  std::swap(dsa_rows, parked_dsa_rows);
}

bool CudaEngine::Impl::lend_on(size_t arena_bytes) const {
  static const bool env = switch_on("MOESRV_LEND_ARENA");
  return opt.lend_pass_arena && env && hybrid_options() && !model && layer_begin == 0 && layer_end == c.num_layers &&
         c.n_routed_experts > 0 && rows > kLendRows &&
         arena_bytes >= size_t(std::max(0.0, opt.lend_min_gib) * double(1ull << 30));
}

// Appends a slot over `mem` to the layer's, free from now on.
void CudaEngine::Impl::add_slot(DevMoe& m, DeviceBuffer mem) {
  CacheSlot cs;
  cs.mem = std::move(mem);
  MOESRV_CUDA_OK(cudaEventCreateWithFlags(&cs.ready, cudaEventDisableTiming));
  MOESRV_CUDA_OK(cudaEventCreateWithFlags(&cs.free, cudaEventDisableTiming));
  MOESRV_CUDA_OK(cudaEventRecord(cs.free, stream));
  m.slots.push_back(std::move(cs));
}

// Layer l's lent slots, appended to its slots: views of the pass arena, as many as its share holds, at most `want`.
int64_t CudaEngine::Impl::lend_slots(int64_t l, int64_t want, size_t slot_bytes) {
  DevMoe& m = *layers[size_t(l)].moe;
  m.lent_from = int64_t(m.slots.size());
  if (!lending || want <= 0 || slot_bytes == 0) return 0;
  const size_t step = (slot_bytes + 255) / 256 * 256;
  const int64_t n = std::min<int64_t>(
      {want, int64_t(lend_each / step), int64_t((lend_bytes - std::min(lend_bytes, lend_cursor)) / step)});
  for (int64_t i = 0; i < n; ++i, lend_cursor += step)
    add_slot(m, DeviceBuffer::view(lend_base + lend_cursor, slot_bytes));
  stats.lent_slots += n;
  return n;
}

// Before a forward of S tokens on a lending engine. A forward of more than kLendRows takes the large set: the lent
// slots' copies (prefetches too) finish first and their experts become misses (their reads finished with the forward
// before, which ends synchronised). A smaller one takes the small set and lends the arena: the forward before ended
// synchronised, so a copy into a lent slot may start at once.
void CudaEngine::Impl::pass_mode(int64_t S) {
  if (!lending || (S > kLendRows) == pass_big) return;
  const bool big = S > kLendRows;
  release_held();  // (left by a pass that failed: withdraw refuses retained experts)
  if (big) MOESRV_CUDA_OK(cudaStreamSynchronize(copy_stream));
  for (int64_t l = 0; l < int64_t(layers.size()); ++l) {
    if (!layers[size_t(l)].moe || !expert_cache) continue;
    DevMoe& m = *layers[size_t(l)].moe;
    if (m.lent_from >= int64_t(m.slots.size())) continue;
    if (big) {
      for (int32_t e : expert_cache->withdraw(int32_t(l))) prefetched[size_t(l)][size_t(e)] = 0;
      continue;
    }
    for (size_t i = size_t(m.lent_from); i < m.slots.size(); ++i)
      MOESRV_CUDA_OK(cudaEventRecord(m.slots[i].free, stream));
    expert_cache->lend(int32_t(l));
  }
  swap_pass_buffers();
  pass_big = big;
  ++stats.arena_switches;
}

void CudaEngine::Impl::allocate_scratch() {
  // R: a pass's rows (the mixers' buffers); RG: a prefill group's (residual streams, MoE rows, the DSA selection).
  const int64_t R = rows, RG = group_rows(), D = c.hidden_size, V = c.vocab_size;
  const auto f32 = [&](int64_t n, const char* what) {
    return DeviceBuffer(budget, size_t(std::max<int64_t>(n, 1)) * 4, what);
  };
  make_pass_buffers(R, RG, s, attn_rows, dsa_rows);
  lending = lend_on(s.pass_arena.bytes());
  if (lending) {  // the small set in use, the large one parked (its arena lent to the MoE layers' slots)
    lend_base = s.pass_arena.as<char>(), lend_bytes = s.pass_arena.bytes();
    make_pass_buffers(kLendRows, kLendRows, parked, parked_attn_rows, parked_dsa_rows);
    swap_pass_buffers();
    pass_big = false;
  }
  if (c.attention == AttentionKind::MLA && c.dsa)  // read by later layers: outside the pass arena
    s.sel = DeviceBuffer(budget, size_t(RG * sel_width()) * 4, "dsa selection");
  if (c.residual.hyper) {
    s.post = f32(RG * c.residual.streams, "mHC post");
    s.comb = f32(RG * c.residual.streams * c.residual.streams, "mHC comb");
    const int n = int(c.residual.streams);
    const size_t part = hyper_enter_scratch(int(std::min<int64_t>(R, 16)), n);
    if (part) s.hc_part = f32(int64_t(part), "mHC partial sums");
    if (hyper_step_supported(1, n, int(c.hidden_size))) {
      s.hc_step = f32(int64_t(hyper_step_scratch(n)), "mHC step scratch");
      MOESRV_CUDA_OK(cudaMemsetAsync(s.hc_step.as<void>(), 0, s.hc_step.bytes(), stream));  // the barrier counters
    }
  }
  if (c.n_routed_experts > 0) {
    const int64_t k = c.experts_per_token, I = c.moe_intermediate_size, E = c.n_routed_experts;
    // Expert buffers of 16M elements, 32M when every expert is in VRAM (no budget, plan or planner): a planned prefill
    // pass then runs in waves of twice the rows (GLM-5.3-Flash: 8,192), fewer launches and wave tails (8K slice,
    // experts phase 0.92 -> 0.80 s; docs/perf-cuda.md, "Twenty-first round"); a budget keeps the VRAM for slots.
    const int64_t buffer_elems = int64_t(hybrid_options() ? 16 : 32) << 20;
    moe_rows = std::min(R, std::max<int64_t>(8, buffer_elems / (k * std::max(D, 2 * I))));
    if (const char* v = std::getenv("MOESRV_MOE_ROWS"))  // (taller expert buffers and waves, for comparisons)
      moe_rows = std::clamp<int64_t>(std::atoll(v), 8, R);
    moe_pass_rows = RG;
    if (const char* v = std::getenv("MOESRV_MOE_PASS_ROWS")) moe_pass_rows = std::clamp<int64_t>(std::atoll(v), 1, RG);
    // Rows of expert work: moe_rows tokens x k, or (grouped decode with the shared expert) 8 tokens x (1 + k).
    const int64_t M = std::max(moe_rows * k, int64_t(kExl3MaxGemvRows) * (k + 1)), P = std::max(RG * k, M);
    moe_wave_rows = opt.moe_wave_rows > 0 ? std::min(opt.moe_wave_rows, M) : M;
    // router logits; decode (route_fused): the per-slice partial logits
    s.logits_r =
        f32(std::max(RG * E, int64_t(route_fused_floats(kRouteFusedMaxTokens, int(E), int(D)))), "router logits");
    s.route_ticket = DeviceBuffer(budget, 4, "router ticket");
    MOESRV_CUDA_OK(cudaMemsetAsync(s.route_ticket.as<void>(), 0, 4, stream));
    s.ids = DeviceBuffer(budget, size_t(P) * 4, "expert ids");
    s.pred_ids = DeviceBuffer(budget, size_t(kRouteFusedMaxTokens * k) * 4, "predicted expert ids");
    s.pred_w = f32(kRouteFusedMaxTokens * k, "predicted expert weights");
    h_pred = PinnedBuffer(size_t(kRouteFusedMaxTokens * k) * 4);
    s.w = f32(P, "expert weights");
    s.mgu = f32(M * 2 * I, "expert gate/up");
    s.mact = f32(M * I, "expert act");
    s.mactb = DeviceBuffer(budget, size_t(M * I) * 2, "expert act bf16");
    s.ysorted = f32(M * D, "expert out");
    s.xs = DeviceBuffer(budget, size_t(M * D) * 2, "expert in");
    s.rowmap = DeviceBuffer(budget, size_t(P) * 4, "expert rowmap");
    s.sorted_tok = DeviceBuffer(budget, size_t(P) * 4, "expert rows");
    s.extra = f32(moe_rows * D, "cpu expert out");
    h_ids = PinnedBuffer(size_t(P) * 4);
    h_w = PinnedBuffer(size_t(P) * 4);
    h_rowmap = PinnedBuffer(size_t(P) * 4);
    h_sorted_tok = PinnedBuffer(size_t(P) * 4);  // h_h, h_extra: a pass's rows, allocated when CPU experts run
    s.row_expert = DeviceBuffer(budget, size_t(P) * 4, "expert of each row");
    h_row_expert = PinnedBuffer(size_t(P) * 4);
    s.wave_tok = DeviceBuffer(budget, size_t(P) * 4, "tokens of each expert wave");
    h_wave_tok = PinnedBuffer(size_t(P) * 4);
    const size_t gemm_tiles = size_t(P / 64 + 2 * E + 64) * sizeof(cuda::Exl3GemmTile);  // 64: the lowest tile
    s.gemm_tiles = DeviceBuffer(budget, gemm_tiles, "EXL3 grouped GEMM tiles");
    h_gemm_tiles = PinnedBuffer(gemm_tiles);
    (void)cuda::exl3_gemm_form();  // probes form 4 on this device now, not inside a later graph capture
    d_usage = DeviceBuffer(budget, size_t(c.num_layers * E) * 4, "expert usage counters");
    d_usage_tokens = DeviceBuffer(budget, size_t(c.num_layers) * 4, "expert usage counters");
    MOESRV_CUDA_OK(cudaMemsetAsync(d_usage.as<void>(), 0, d_usage.bytes(), stream));
    MOESRV_CUDA_OK(cudaMemsetAsync(d_usage_tokens.as<void>(), 0, d_usage_tokens.bytes(), stream));
    usage = std::make_unique<UsageStats>(c.num_layers, E, k);
  }
  lm_rows = std::clamp<int64_t>(kSliceFloats / V, 1, R);
  if (layer_end == c.num_layers) {  // lm_head's output: the last stage only
    s.logits = f32(lm_rows * V, "logits");
    h_logits = PinnedBuffer(size_t(lm_rows * V) * 4);
  }
  d_pos0 = DeviceBuffer(budget, 4, "position");
  d_argmax = DeviceBuffer(budget, 16 + argmax_scratch_bytes(), "argmax");
  MOESRV_CUDA_OK(cudaMemsetAsync(d_argmax.as<void>(), 0, d_argmax.bytes(), stream));
  h_argmax = PinnedBuffer(4);
  d_slice_pos = DeviceBuffer(budget, 4, "position");
  d_tokens = DeviceBuffer(budget, size_t(RG) * 4, "tokens");
  d_group_pos = DeviceBuffer(budget, size_t(group_passes) * 4, "group positions");
  h_group_pos = PinnedBuffer(size_t(group_passes) * 4);
  d_layer_cache = DeviceBuffer(budget, size_t(c.num_layers) * sizeof(DeviceLayerCache), "cache table");
  d_batch_pos = DeviceBuffer(budget, size_t(kMaxBatchRows) * 4, "batch positions");
  d_batch_tables =
      DeviceBuffer(budget, size_t(kMaxBatchRows * c.num_layers) * sizeof(DeviceLayerCache), "cache tables");
  h_batch_pos = PinnedBuffer(size_t(kMaxBatchRows) * 4);
  h_batch_tables = PinnedBuffer(size_t(kMaxBatchRows * c.num_layers) * sizeof(DeviceLayerCache));
  h_pos0 = PinnedBuffer(4);
  h_tokens = PinnedBuffer(size_t(RG) * 4);
  h_layer_cache = PinnedBuffer(size_t(c.num_layers) * sizeof(DeviceLayerCache));
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
