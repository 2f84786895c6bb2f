#include <gtest/gtest.h>

#include <filesystem>

#include "format/index_repair.h"
#include "format/lock.h"
#include "format/package.h"
#include "test_lock_helpers.h"
#include "util/error.h"

using namespace moesrv;
using namespace moesrv::testutil;
using json = nlohmann::json;

namespace {

const std::string kDsa = std::string(MOESRV_TESTDATA) + "/hf-tiny/glm_moe_dsa";

void write_index(const std::string& dir, const std::map<std::string, std::string>& wm, uint64_t total = 0) {
  json j = {{"metadata", {{"total_size", total}}}, {"weight_map", wm}};
  write_file(dir + "/" + kIndexFileName, j.dump(2));
}

// Two shards: a.safetensors {x, y}, b.safetensors {z}; the index only lists x.
void make_broken_package(const std::string& dir) {
  write_file(dir + "/config.json", R"({"model_type":"toy","num_hidden_layers":1})");
  write_shard(dir + "/a.safetensors", {{"x", {4, 4}}, {"y", {8}}});
  write_shard(dir + "/b.safetensors", {{"z", {2, 3}}});
  write_index(dir, {{"x", "a.safetensors"}}, 64);
}

RepairOptions quiet() {
  RepairOptions o;
  o.progress = false;
  return o;
}

HashOptions quiet_hash() {
  HashOptions o;
  o.progress = false;
  return o;
}

}  // namespace

TEST(RepairIndex, AddsUnindexedTensorsAndShards) {
  TempDir d;
  make_broken_package(d.str());
  std::string before = read_file(d / kIndexFileName);
  auto pkg = ModelPackage::open(d.str());
  EXPECT_EQ(pkg->unindexed().size(), 2u);
  try {
    pkg->require("z");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("repair-index"), std::string::npos) << e.what();
  }

  RepairReport r = repair_index(d.str(), quiet());
  EXPECT_TRUE(r.changed);
  EXPECT_TRUE(r.written);
  EXPECT_EQ(r.added.size(), 2u);
  EXPECT_EQ(r.new_shards, std::vector<std::string>{"b.safetensors"});
  EXPECT_EQ(r.total_size, uint64_t((16 + 8 + 6) * 4));
  EXPECT_EQ(read_file(d / (std::string(kIndexFileName) + ".bak")), before);

  json idx = read_json_file(d / kIndexFileName);
  EXPECT_EQ(idx["metadata"]["total_size"], (16 + 8 + 6) * 4);
  EXPECT_EQ(idx["weight_map"]["z"], "b.safetensors");

  pkg = ModelPackage::open(d.str());
  EXPECT_TRUE(pkg->unindexed().empty());
  const TensorView& z = pkg->require("z");
  EXPECT_EQ(z.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_FLOAT_EQ(z.at(5), 1.0f + 5);  // first tensor of its shard: seed 1

  RepairReport again = repair_index(d.str(), quiet());
  EXPECT_FALSE(again.changed);
  EXPECT_FALSE(again.written);
}

TEST(RepairIndex, DryRunWritesNothing) {
  TempDir d;
  make_broken_package(d.str());
  std::string before = read_file(d / kIndexFileName);
  RepairOptions o = quiet();
  o.dry_run = true;
  RepairReport r = repair_index(d.str(), o);
  EXPECT_TRUE(r.changed);
  EXPECT_FALSE(r.written);
  EXPECT_EQ(read_file(d / kIndexFileName), before);
  EXPECT_FALSE(fs::exists(d / (std::string(kIndexFileName) + ".bak")));
}

TEST(RepairIndex, FixesTensorPlacedInTheWrongShard) {
  TempDir d;
  make_broken_package(d.str());
  write_index(d.str(), {{"x", "a.safetensors"}, {"y", "a.safetensors"}, {"z", "a.safetensors"}});
  EXPECT_THROW(ModelPackage::open(d.str()), Error);
  RepairReport r = repair_index(d.str(), quiet());
  ASSERT_EQ(r.moved.size(), 1u);
  EXPECT_NE(r.moved[0].find("z: a.safetensors -> b.safetensors"), std::string::npos);
  EXPECT_EQ(ModelPackage::open(d.str())->require("z").numel(), 6);
}

TEST(RepairIndex, TensorInNoShardIsAnError) {
  TempDir d;
  make_broken_package(d.str());
  write_index(d.str(), {{"x", "a.safetensors"}, {"gone", "c.safetensors"}});
  try {
    repair_index(d.str(), quiet());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gone"), std::string::npos) << e.what();
  }
}

TEST(RepairIndex, RelocksOnlyWhenShardsVerify) {
  TempDir d;
  make_broken_package(d.str());
  write_package_lock(d.str(), quiet_hash());  // the lock records the broken index, as downloaded
  RepairReport r = repair_index(d.str(), quiet());
  EXPECT_TRUE(r.lock_updated) << r.text();
  VerifyOptions vo;
  vo.progress = false;
  VerifyReport v = verify_package(d.str(), vo);
  EXPECT_TRUE(v.ok()) << v.text();
  EXPECT_TRUE(v.issues.empty()) << v.text();
}

TEST(RepairIndex, ShardFailingTheLockBlocksTheRepair) {
  TempDir d;
  make_broken_package(d.str());
  write_package_lock(d.str(), quiet_hash());
  std::string lock_before = read_file(d / kLockFileName);
  std::string index_before = read_file(d / kIndexFileName);
  flip_byte(d / "b.safetensors", fs::file_size(d / "b.safetensors") - 1);  // tensor data, header still valid
  try {
    repair_index(d.str(), quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("NOT written"), std::string::npos) << m;
    EXPECT_NE(m.find("b.safetensors: sha256 mismatch"), std::string::npos) << m;
  }
  EXPECT_EQ(read_file(d / kIndexFileName), index_before);
  EXPECT_EQ(read_file(d / kLockFileName), lock_before);

  RepairOptions o = quiet();
  o.require_lock_ok = false;
  RepairReport r = repair_index(d.str(), o);
  EXPECT_TRUE(r.written);
  EXPECT_FALSE(r.lock_updated);
  EXPECT_EQ(read_file(d / kLockFileName), lock_before);
}

TEST(RepairIndex, AddedShardNotInLockBlocksTheRepair) {
  TempDir d;
  make_broken_package(d.str());
  fs::rename(d / "b.safetensors", d / "b.hold");
  write_package_lock(d.str(), quiet_hash());
  fs::rename(d / "b.hold", d / "b.safetensors");
  try {
    repair_index(d.str(), quiet());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("b.safetensors: not in lock"), std::string::npos) << e.what();
  }
}

TEST(RepairIndex, NoIndexIsAClearError) {
  TempDir d;
  write_file(d / "config.json", "{}");
  write_shard(d / "model.safetensors", {{"x", {2}}});
  EXPECT_THROW(repair_index(d.str(), quiet()), Error);
}

TEST(RequiredTensors, DsaIndexerFollowsIndexerTypes) {
  json cfg = read_json_file(kDsa + "/config.json");
  auto req = required_indexer_tensors(cfg);
  EXPECT_EQ(req.size(), 15u);  // layers 0, 1, 3 are "full"; layer 2 is "shared"
  for (const auto& n : req) EXPECT_EQ(n.find("model.layers.2."), std::string::npos) << n;
  EXPECT_NE(std::find(req.begin(), req.end(), "model.layers.3.self_attn.indexer.wk.weight"), req.end());
  EXPECT_TRUE(package_missing_tensors(*ModelPackage::open(kDsa), req).empty());

  json glm4 = read_json_file(std::string(MOESRV_TESTDATA) + "/hf-tiny/glm4_moe/config.json");
  EXPECT_TRUE(required_indexer_tensors(glm4).empty());
  // Hybrid configs: only the DSA attention layers carry an indexer.
  json hybrid = {{"text_config",
                  {{"index_head_dim", 128}, {"num_hidden_layers", 3}, {"indexer_types", {"full", "full", "full"}},
                   {"layer_types", {"linear_attention", "deepseek_sparse_attention", "linear_attention"}}}}};
  auto h = required_indexer_tensors(hybrid);
  ASSERT_EQ(h.size(), 5u);
  EXPECT_EQ(h[0].rfind("model.layers.1.", 0), 0u);
}

// The real case: DSA indexer weights of one layer ship in an aux shard the index never names.
TEST(RepairIndex, DsaIndexerShardGetsIndexedAndServed) {
  TempDir d;
  auto src = SafetensorsFile::open(kDsa + "/model.safetensors");
  std::vector<TensorView> main_part, aux_part;
  std::map<std::string, std::string> wm;
  for (const auto& [name, t] : src->tensors()) {
    if (name.find("layers.3.self_attn.indexer.") != std::string::npos) {
      aux_part.push_back(t);
    } else {
      main_part.push_back(t);
      wm[name] = "model-00001-of-00001.safetensors";
    }
  }
  ASSERT_EQ(aux_part.size(), 5u);
  write_safetensors(d / "model-00001-of-00001.safetensors", main_part);
  write_safetensors(d / "model-indexer.safetensors", aux_part);
  fs::copy_file(kDsa + "/config.json", d / "config.json");
  write_index(d.str(), wm);

  auto pkg = ModelPackage::open(d.str());
  auto required = required_indexer_tensors(pkg->config());
  auto missing = package_missing_tensors(*pkg, required);
  ASSERT_EQ(missing.size(), 5u);
  EXPECT_THROW(pkg->require(missing[0]), Error);

  RepairReport r = repair_index(d.str(), quiet());
  EXPECT_EQ(r.added.size(), 5u);
  pkg = ModelPackage::open(d.str());
  EXPECT_TRUE(package_missing_tensors(*pkg, required).empty());
  const TensorView& wk = pkg->require("model.layers.3.self_attn.indexer.wk.weight");
  const TensorView* orig = src->find("model.layers.3.self_attn.indexer.wk.weight");
  ASSERT_EQ(wk.nbytes, orig->nbytes);
  EXPECT_EQ(std::memcmp(wk.data, orig->data, wk.nbytes), 0);
  uint64_t total = 0;
  for (const auto& [n, t] : src->tensors()) total += t.nbytes;
  EXPECT_EQ(read_json_file(d / kIndexFileName)["metadata"]["total_size"], total);
}
