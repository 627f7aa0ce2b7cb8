// `dflashd inspect target` end to end (the real binary) against the transformers references,
// and the token-file reader's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/safetensors.h"
#include "common/token_file.h"
#include "tests/test_util.h"

namespace dflash {
namespace {

const std::string kBinary = std::getenv("DFLASHD_BINARY") ? std::getenv("DFLASHD_BINARY") : DFLASHD_BINARY;
const std::string kReferenceDir = DFLASHD_TARGET_REFERENCE_DIR;

std::vector<float> floats(const TensorEntry& e) {
  std::vector<float> out(static_cast<size_t>(e.numel()));
  std::memcpy(out.data(), e.data, e.bytes);
  return out;
}

TEST(Inspect, DumpsTappedLayersMatchingTransformersPaddedPerSequence) {
  const std::string dir = test::make_temp_dir("inspect");
  const std::string model = kReferenceDir + "/qwen3_5";
  auto reference = SafetensorsFile::open(model + "/reference.safetensors");
  // The reference sequences as a token file (in a different order: 1, 0).
  std::ofstream tokens(dir + "/tokens.jsonl");
  std::vector<int64_t> lengths;
  for (int s : {1, 0}) {
    const TensorEntry& ids = reference->get("seq." + std::to_string(s) + ".input_ids");
    std::vector<int64_t> values(static_cast<size_t>(ids.numel()));
    std::memcpy(values.data(), ids.data, ids.bytes);
    tokens << "{\"input_ids\": [";
    for (size_t i = 0; i < values.size(); ++i) tokens << (i ? "," : "") << values[i];
    tokens << "]}\n\n";  // blank lines are skipped
    lengths.push_back(static_cast<int64_t>(values.size()));
  }
  tokens.close();
  test::Process inspect({kBinary, "inspect", "target", "--model", model, "--tokens", dir + "/tokens.jsonl", "--layers",
                         "3,1", "--out", dir + "/out.safetensors"},
                        {}, dir);
  ASSERT_EQ(inspect.wait(), 0) << inspect.err();
  auto out = SafetensorsFile::open(dir + "/out.safetensors");
  const int64_t longest = std::max(lengths[0], lengths[1]);
  for (int layer : {1, 3}) {
    const TensorEntry& dumped = out->get("layer." + std::to_string(layer));
    ASSERT_EQ(dumped.shape, (std::vector<int64_t>{2, longest, 48}));
    const std::vector<float> values = floats(dumped);
    for (int row = 0; row < 2; ++row) {
      const int s = row == 0 ? 1 : 0;
      const std::vector<float> expected = floats(reference->get("seq." + std::to_string(s) + ".layer." + std::to_string(layer)));
      double worst = 0, scale = 0;
      for (int64_t t = 0; t < longest; ++t) {
        for (int64_t h = 0; h < 48; ++h) {
          const float ours = values[(row * longest + t) * 48 + h];
          if (t >= lengths[row]) {
            ASSERT_EQ(ours, 0.0f) << "padding must be zero";
            continue;
          }
          const float ref = expected[t * 48 + h];
          worst = std::max(worst, static_cast<double>(std::fabs(ours - ref)));
          scale = std::max(scale, static_cast<double>(std::fabs(ref)));
        }
      }
      EXPECT_LE(worst / scale, 1e-5) << "layer " << layer << " row " << row;
    }
  }
  const TensorEntry& lengths_entry = out->get("lengths");
  std::vector<int64_t> got(2);
  std::memcpy(got.data(), lengths_entry.data, 16);
  EXPECT_EQ(got, lengths);
}

TEST(Inspect, BadInputsAreClearErrors) {
  const std::string dir = test::make_temp_dir("inspect-bad");
  const std::string model = kReferenceDir + "/qwen3";
  std::ofstream(dir + "/bad.jsonl") << "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, \"x\"]}\n";
  test::Process bad_line({kBinary, "inspect", "target", "--model", model, "--tokens", dir + "/bad.jsonl", "--layers",
                          "1", "--out", dir + "/o.safetensors"},
                         {}, dir);
  EXPECT_EQ(bad_line.wait(), 1);
  EXPECT_NE(bad_line.err().find(dir + "/bad.jsonl:2: input_ids must hold non-negative integers, found \"x\""),
            std::string::npos) << bad_line.err();

  std::ofstream(dir + "/ok.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  test::Process bad_layer({kBinary, "inspect", "target", "--model", model, "--tokens", dir + "/ok.jsonl", "--layers",
                           "1,9", "--out", dir + "/o.safetensors"},
                          {}, dir);
  EXPECT_EQ(bad_layer.wait(), 2);
  EXPECT_NE(bad_layer.err().find("layer 9 does not exist"), std::string::npos) << bad_layer.err();

  std::ofstream(dir + "/big.jsonl") << "{\"input_ids\": [1, 99999]}\n";
  test::Process bad_id({kBinary, "inspect", "target", "--model", model, "--tokens", dir + "/big.jsonl", "--layers", "1",
                        "--out", dir + "/o.safetensors"},
                       {}, dir);
  EXPECT_EQ(bad_id.wait(), 1);
  EXPECT_NE(bad_id.err().find(dir + "/big.jsonl:1: token id 99999 is outside the vocabulary"), std::string::npos)
      << bad_id.err();

  test::Process no_model({kBinary, "inspect", "target", "--model", dir, "--tokens", dir + "/ok.jsonl", "--layers", "1",
                          "--out", dir + "/o.safetensors"},
                         {}, dir);
  EXPECT_EQ(no_model.wait(), 1);
  EXPECT_NE(no_model.err().find(dir + "/config.json: cannot read"), std::string::npos) << no_model.err();
  EXPECT_FALSE(std::ifstream(dir + "/o.safetensors").good()) << "nothing half-written";

  test::Process usage({kBinary, "inspect", "target", "--model", model}, {}, dir);
  EXPECT_EQ(usage.wait(), 2);
}

TEST(TokenFile, MalformedLinesNameFileAndLine) {
  auto error = [](const std::string& line) {
    try {
      parse_token_line(line, "data.jsonl", 7);
    } catch (const TokenFileError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("{oops").find("data.jsonl:7: invalid JSON"), std::string::npos);
  EXPECT_EQ(error("{\"ids\": [1]}"), "data.jsonl:7: expected an object with an \"input_ids\" list");
  EXPECT_EQ(error("{\"input_ids\": [1, -2]}"), "data.jsonl:7: input_ids must hold non-negative integers, found -2");
  EXPECT_EQ(error("{\"input_ids\": [1, 2], \"loss_mask\": [1]}"), "data.jsonl:7: loss_mask has 1 entries for 2 input_ids");
  EXPECT_EQ(error("{\"input_ids\": [1], \"loss_mask\": [2]}"), "data.jsonl:7: loss_mask must hold 0 or 1, found 2");
  const TokenSample ok = parse_token_line("{\"input_ids\": [5, 6], \"loss_mask\": [0, 1]}", "d", 3);
  EXPECT_EQ(ok.input_ids, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(ok.loss_mask, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(ok.line, 3);
}

}  // namespace
}  // namespace dflash
