// main() of the test binaries that use libtorch. libtorch seeds its default generators from the
// operating system's entropy in every process, so a test drawing its inputs from them (at::randint
// without a generator) would test different inputs in each run and a failure would not reproduce.
// Every test here starts from the same seed instead; a test that seeds them itself still does.
#include <ATen/Context.h>
#include <gtest/gtest.h>

namespace {

constexpr uint64_t kTestSeed = 20261208;

class SeedEachTest : public testing::EmptyTestEventListener {
  void OnTestStart(const testing::TestInfo& /*test*/) override { at::manual_seed(kTestSeed); }
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  testing::UnitTest::GetInstance()->listeners().Append(new SeedEachTest);  // gtest owns it
  return RUN_ALL_TESTS();
}
