// safetensors reader/writer: round trip, and every corrupt-input case of the format, each
// with an error naming the file (and the tensor where one is at fault).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "common/safetensors.h"
#include "common/token_file.h"
#include "tests/test_util.h"

namespace dflash {
namespace {

std::string write_raw(const std::string& dir, const std::string& name, const std::string& header,
                      const std::string& data, int64_t declared_length = -1) {
  const std::string path = dir + "/" + name;
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = declared_length >= 0 ? static_cast<uint64_t>(declared_length) : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << data;
  return path;
}

std::string open_error(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Safetensors, RoundTripKeepsNamesShapesDtypesBytesAndMetadata) {
  const std::string dir = test::make_temp_dir("st");
  std::vector<float> a{1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  std::vector<uint16_t> b{0x3f80, 0xc000};  // bf16 1.0, -2.0
  std::vector<int64_t> c{42};
  write_safetensors(dir + "/x.safetensors",
                    {{"a", DType::F32, {2, 3}, a.data(), 24}, {"b", DType::BF16, {2}, b.data(), 4},
                     {"scalar", DType::I64, {}, c.data(), 8}},
                    {{"format", "pt"}});
  auto file = SafetensorsFile::open(dir + "/x.safetensors");
  ASSERT_EQ(file->tensors().size(), 3u);
  const TensorEntry& ea = file->get("a");
  EXPECT_EQ(ea.dtype, DType::F32);
  EXPECT_EQ(ea.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(ea.data, a.data(), 24), 0);
  EXPECT_EQ(file->get("b").dtype, DType::BF16);
  EXPECT_EQ(std::memcmp(file->get("b").data, b.data(), 4), 0);
  EXPECT_EQ(file->get("scalar").shape.size(), 0u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->find("missing"), nullptr);
  EXPECT_EQ(std::string(dtype_name(DType::F8_E4M3)), "F8_E4M3");
  // The data buffer starts 8-byte aligned (header padded), as the reference writes it.
  std::ifstream in(dir + "/x.safetensors", std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, MissingTensorNamesFileAndTensor) {
  const std::string dir = test::make_temp_dir("st-missing");
  float x = 1;
  write_safetensors(dir + "/m.safetensors", {{"x", DType::F32, {1}, &x, 4}});
  try {
    SafetensorsFile::open(dir + "/m.safetensors")->get("model.norm.weight");
    FAIL();
  } catch (const SafetensorsError& e) {
    EXPECT_EQ(std::string(e.what()), dir + "/m.safetensors: missing tensor 'model.norm.weight'");
  }
}

TEST(Safetensors, WriterRejectsByteCountMismatchAndDuplicates) {
  const std::string dir = test::make_temp_dir("st-w");
  float x[2] = {1, 2};
  EXPECT_THROW(write_safetensors(dir + "/a.safetensors", {{"x", DType::F32, {3}, x, 8}}), SafetensorsError);
  EXPECT_THROW(write_safetensors(dir + "/a.safetensors", {{"x", DType::F32, {1}, x, 4}, {"x", DType::F32, {1}, x, 4}}),
               SafetensorsError);
  // Nothing half-written is left behind.
  EXPECT_FALSE(std::ifstream(dir + "/a.safetensors").good());
}

TEST(Safetensors, CorruptInputsAreClearErrors) {
  const std::string dir = test::make_temp_dir("st-bad");
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\0');
  struct Case {
    const char* name;
    std::string header, data;
    int64_t declared;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"tiny", "", "", -2, "truncated: 3 bytes, shorter than the 8-byte header length"},
      {"huge_header", ok_header, eight, 200'000'000, "corrupt header: header length 200000000 exceeds the 100 MB limit"},
      {"short_header", ok_header, "", 4096, "truncated: the header claims 4096 bytes"},
      {"not_json", "{not json}", "", -1, "corrupt header: invalid JSON"},
      {"not_object", "[1, 2]", "", -1, "corrupt header: it is not a JSON object"},
      {"duplicate", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       eight, -1, "corrupt header: tensor 'w' appears twice"},
      {"dtype", R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,8]}})", eight, -1, "tensor 'w': unsupported dtype \"F4\""},
      {"truncated_data", ok_header, "1234", -1, "tensor 'w': data_offsets [0, 8] out of bounds of the 4-byte data buffer (truncated file?)"},
      {"shape_mismatch", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight, -1,
       "tensor 'w': shape [3] of F32 needs 12 bytes but data_offsets give 8"},
      {"overlap", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       eight, -1, "starts at byte 4 inside the previous tensor (overlap)"},
      {"gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight, -1,
       "corrupt header: tensor 'a' starts at byte 4 leaving a gap, expected 0"},
      {"trailing_bytes", ok_header, eight + "xx", -1,
       "file size is not exact: the tensors end at byte 8 of a 10-byte data buffer"},
      {"offsets_shape", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight, -1,
       "corrupt header: tensor 'w': data_offsets must be [begin, end]"},
      {"negative_shape", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight, -1,
       "is not a list of sizes"},
      // 2^32 x 2^32 x 2^32 x 2^32 two-byte elements: 2^129 bytes, which wrapped to 0 in 128 bits.
      {"size_overflow",
       R"({"w":{"dtype":"BF16","shape":[4294967296,4294967296,4294967296,4294967296],"data_offsets":[0,0]}})", "", -1,
       "needs more than 2^64 bytes"},
      {"deep", "{\"__metadata__\":" + std::string(100000, '[') + std::string(100000, ']') + "}", "", -1,
       "corrupt header: nested deeper than 64 levels"},
      {"nul", ok_header + std::string(1, '\0') + "garbage", eight, -1, "corrupt header: a NUL byte at offset"},
  };
  for (const Case& c : cases) {
    std::string path;
    if (c.declared == -2) {
      path = dir + "/" + c.name;
      std::ofstream(path) << "abc";
    } else {
      path = write_raw(dir, c.name, c.header, c.data, c.declared);
    }
    const std::string error = open_error(path);
    EXPECT_EQ(error.rfind(path + ": ", 0), 0u) << c.name << ": " << error;
    EXPECT_NE(error.find(c.expected), std::string::npos) << c.name << ": " << error;
  }
  EXPECT_NE(open_error(dir + "/absent").find(dir + "/absent: cannot open"), std::string::npos);
}

// Data lines and token files as a new user's data may have them: bounded nesting (a line nested
// 100,000 deep overflowed the stack while the error message was printed), no NUL byte (the
// parser took it for the end of the line and accepted what came before).
TEST(TokenFile, DeepNestingAndNulBytesAreClearErrors) {
  const std::string deep = "{\"input_ids\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  try {
    parse_token_line(deep, "train.jsonl", 3);
    FAIL() << "accepted";
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("train.jsonl:3: invalid JSON: nested deeper than 64 levels"), std::string::npos)
        << e.what();
  }
  const std::string nul = std::string("{\"input_ids\": [1, 2], \"loss_mask\": [0, 1]}") + '\0' + "garbage";
  try {
    parse_token_line(nul, "train.jsonl", 4);
    FAIL() << "accepted";
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("train.jsonl:4: invalid JSON: a NUL byte at offset 42"), std::string::npos)
        << e.what();
  }
  // Brackets inside strings do not count as nesting; a real line still parses.
  try {
    parse_token_line("{\"x\": \"" + std::string(1000, '[') + "\"}", "f", 1);
    FAIL() << "accepted";
  } catch (const TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("expected an object with an \"input_ids\" list"), std::string::npos) << e.what();
  }
  const TokenSample ok = parse_token_line(R"({"note": "[[[[", "input_ids": [5, 6], "loss_mask": [0, 1]})", "f", 1);
  EXPECT_EQ(ok.input_ids, (std::vector<int64_t>{5, 6}));
}

}  // namespace
}  // namespace dflash
