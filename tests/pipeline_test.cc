// The training pipeline: unit tests of its pieces (step plan, data, queue) and end-to-end runs
// of the real binary on CPU: a whole run, SIGTERM with a checkpoint, SIGKILL-and-resume
// bit-identical at several kill points, a worker that throws, malformed data, and a metrics
// scrape during training with every pipeline metric present.
#include <gtest/gtest.h>
#include <httplib.h>
#include <dirent.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "pipeline/bounded_queue.h"
#include "pipeline/nccl_gradients.h"
#include "pipeline/streams.h"
#include "pipeline/dataset.h"
#include "common/dir_lock.h"
#include "decode/shards.h"
#include "pipeline/flops.h"
#include "target/model_config.h"
#include "tests/run_dir.h"
#include "tests/test_util.h"

namespace dflash::pipeline {
namespace {

const std::string kBinary = std::getenv("DFLASHD_BINARY") ? std::getenv("DFLASHD_BINARY") : DFLASHD_BINARY;
// The same program with the test hooks read from its environment (tests/faulty_daemon_hooks.cc).
const std::string kFaulty = DFLASHD_FAULTY_BINARY;


// MFU's drafter FLOPs: a sliding-window layer's attention counts the pairs its mask keeps (the
// window on the context, causal in the block), a full layer's every context key before the
// anchor and the whole block.
TEST(Flops, SlidingWindowLayersCountTheirWindowedPairs) {
  const std::vector<int64_t> anchors{0, 3, 100};
  EXPECT_EQ(pipeline::drafter_attention_pairs(anchors, 4, 0), 4 * 4 + 4 * 7 + 4 * 104);
  // Window 5, rows i = 0..3 see min(a, 4 - i) context keys and i + 1 block keys:
  // a = 0: 1+2+3+4; a = 3: (3+1)+(3+2)+(2+3)+(1+4); a = 100: (4+1)+(3+2)+(2+3)+(1+4).
  EXPECT_EQ(pipeline::drafter_attention_pairs(anchors, 4, 5), 10 + 19 + 20);
  drafter::DrafterShape s;
  s.hidden_size = 64, s.num_layers = 2, s.num_attention_heads = 4, s.num_key_value_heads = 2, s.head_dim = 16;
  s.intermediate_size = 96, s.vocab_size = 512, s.block_size = 4, s.target_layer_ids = {1, 2};
  const double full = pipeline::drafter_flops(s, 200, anchors);
  s.layer_types = {"sliding_attention", "full_attention"};
  s.sliding_window = 5;
  const double sliding = pipeline::drafter_flops(s, 200, anchors);
  // 3x forward, 4 FLOP per pair and query-head dimension: the difference is layer 0's pairs.
  EXPECT_DOUBLE_EQ(full - sliding, 3.0 * 4.0 * 4 * 16 * (pipeline::drafter_attention_pairs(anchors, 4, 0) -
                                                         pipeline::drafter_attention_pairs(anchors, 4, 5)));
}

TEST(StepPlan, EveryEpochSampleExactlyOnceAcrossStepsAndReplicas) {
  const StepPlan plan = StepPlan::make(/*samples*/ 23, /*replicas*/ 2, /*m*/ 2, /*accumulation*/ 3, /*epochs*/ 2.0, 0);
  EXPECT_EQ(plan.global_batch(), 12);
  EXPECT_EQ(plan.steps_per_epoch, 2);  // 12 + 11 (the last step is partial)
  EXPECT_EQ(plan.total_steps, 4);
  std::vector<int> seen(46, 0);
  for (int64_t step = 0; step < plan.total_steps; ++step) {
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t q : plan.samples_for(step, r)) {
        ++seen[q];
        EXPECT_EQ(plan.step_of(q), step);
        EXPECT_EQ(plan.replica_of(q), r);
      }
    }
  }
  for (int v : seen) EXPECT_EQ(v, 1);
  EXPECT_EQ(plan.samples_for(1, 1).size(), 5u);  // partial step: replica 1 gets the remainder
  EXPECT_EQ(StepPlan::make(23, 1, 1, 1, 1.0, 7).total_steps, 7);  // max_steps wins
}

TEST(Dataset, ShufflesPerEpochDeterministicallyAndSkipsWithCounts) {
  config::DataConfig c;
  c.synthetic.sequences = 50;
  c.synthetic.min_length = 8;
  c.synthetic.max_length = 20;
  c.max_length = 12;
  c.min_supervised_tokens = 6;
  auto d = Dataset::open(c, 100);
  EXPECT_EQ(d->size() + d->skipped_short(), 50);
  EXPECT_GT(d->skipped_short(), 0);  // short synthetic samples have < 6 supervised tokens
  std::set<int64_t> epoch0, epoch1;
  bool differs = false;
  for (int64_t p = 0; p < d->size(); ++p) {
    epoch0.insert(d->sample_at(0, p));
    epoch1.insert(d->sample_at(1, p));
    differs |= d->sample_at(0, p) != d->sample_at(1, p);
  }
  EXPECT_EQ(static_cast<int64_t>(epoch0.size()), d->size());
  EXPECT_EQ(epoch0, epoch1);
  EXPECT_TRUE(differs) << "each epoch has its own order";
  auto again = Dataset::open(c, 100);
  EXPECT_EQ(again->sample_at(1, 3), d->sample_at(1, 3));
  for (int64_t i = 0; i < d->size(); ++i) EXPECT_LE(d->load(i).input_ids.size(), 12u) << "truncated";
}

TEST(Dataset, MalformedLinesErrorWithFileAndLineOrAreSkipped) {
  const std::string dir = test::make_temp_dir("data");
  std::ofstream(dir + "/a.jsonl") << "{\"input_ids\": [1,2,3,4], \"loss_mask\": [0,1,1,1]}\n"
                                     "{\"input_ids\": [1,2,3], \"loss_mask\": [1,1]}\n"
                                     "{\"input_ids\": [5,6,7,8], \"loss_mask\": [1,1,1,1]}\n";
  config::DataConfig c;
  c.paths = {dir};
  try {
    Dataset::open(c, 100);
    FAIL();
  } catch (const TokenFileError& e) {
    EXPECT_EQ(std::string(e.what()), dir + "/a.jsonl:2: loss_mask has 2 entries for 3 input_ids");
  }
  c.on_malformed = config::OnMalformed::skip;
  auto d = Dataset::open(c, 100);
  EXPECT_EQ(d->size(), 2);
  EXPECT_EQ(d->skipped_malformed(), 1);
  EXPECT_EQ(d->load(1).input_ids, (std::vector<int64_t>{5, 6, 7, 8}));
  config::DataConfig missing;
  missing.paths = {dir + "/nope.jsonl"};
  EXPECT_THROW(Dataset::open(missing, 100), std::runtime_error);
  // A file listed and within a listed directory would be trained on twice.
  config::DataConfig twice;
  twice.paths = {dir, dir + "/./a.jsonl"};
  try {
    Dataset::open(twice, 100);
    ADD_FAILURE() << "a file read twice was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "data.paths: " + dir + "/./a.jsonl is read twice (also as " + dir + "/a.jsonl); list each file once");
  }
}

// A `dflashd generate` output directory (data.paths) is read by its committed shards only: a
// shard without its commit marker (a generate run cut short, or one committing right now) would
// give its prompts twice once generate runs them again.
TEST(Dataset, AGenerateOutputIsReadByItsCommittedShardsOnly) {
  const std::string dir = test::make_temp_dir("generated") + "/out";
  {
    decode::ShardedOutput out(dir, "{\"prompts\": 5}", 2, false);
    out.add({0, {1, 2, 3, 4}, 1, true});
    out.add({3, {5, 6, 7}, 1, true});
    out.add({1, {8, 9, 10}, 1, false});  // truncated: handled, not written
    out.add({4, {11, 12, 13}, 1, true});
    out.add({2, {14, 15, 16}, 1, true});  // buffered: never committed
  }
  std::ofstream(dir + "/shard-000002.jsonl") << "{\"input_ids\": [20, 21, 22], \"loss_mask\": [0, 1, 1]}\n";
  std::ofstream(dir + "/shard-000003.jsonl.tmp-77") << "{\"input_ids\": [";
  const decode::GeneratedData g = decode::generated_data(dir);
  EXPECT_EQ(g.files, (std::vector<std::string>{dir + "/shard-000000.jsonl", dir + "/shard-000001.jsonl"}));
  EXPECT_EQ(g.uncommitted, std::vector<std::string>{dir + "/shard-000002.jsonl"});
  EXPECT_EQ(g.prompts, 5);
  EXPECT_EQ(g.done, 4);
  config::DataConfig c;
  c.paths = {dir};
  c.shuffle = false;
  auto d = Dataset::open(c, 100);
  ASSERT_EQ(d->size(), 3);
  EXPECT_EQ(d->load(0).input_ids, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(d->load(1).input_ids, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(d->load(2).input_ids, (std::vector<int64_t>{11, 12, 13}));
  // A marker whose samples were removed by hand is refused, naming it (by generate as well).
  ASSERT_EQ(std::remove((dir + "/shard-000001.jsonl").c_str()), 0);
  for (auto open : {std::function<void()>([&] { Dataset::open(c, 100); }),
                    std::function<void()>([&] { decode::ShardedOutput(dir, "{\"prompts\": 5}", 2, false); })}) {
    try {
      open();
      ADD_FAILURE() << "a marker without its samples was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(dir + "/shard-000001.done: a commit marker without its samples"),
                std::string::npos)
          << e.what();
    }
  }
  // A job that has committed nothing yet is no training data.
  const std::string fresh = test::make_temp_dir("generated-fresh") + "/out";
  decode::ShardedOutput(fresh, "{\"prompts\": 5}", 2, false);
  c.paths = {fresh};
  try {
    Dataset::open(c, 100);
    ADD_FAILURE() << "an output without committed shards was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("without a committed shard yet (0 of 5 prompts done)"), std::string::npos)
        << e.what();
  }
}

// The digest a checkpoint records and nodes compare: it follows the samples' content, the order's
// seed and the held-out choice, not where the files lie.
TEST(Dataset, DigestFollowsTheSamplesTheirOrderAndTheHeldOutChoiceNotThePaths) {
  const std::string a = test::make_temp_dir("digest-a"), b = test::make_temp_dir("digest-b");
  std::string lines = "{\"input_ids\": [1,2,3,4], \"loss_mask\": [0,1,1,1]}\n";
  for (int i = 0; i < 15; ++i) {
    lines += "{\"input_ids\": [5,6,7," + std::to_string(8 + i) + "], \"loss_mask\": [1,1,1,1]}\n";
  }
  std::ofstream(a + "/x.jsonl") << lines;
  std::ofstream(b + "/y.jsonl") << lines;
  config::DataConfig c;
  c.paths = {a};
  const std::string base = Dataset::open(c, 100)->digest();
  EXPECT_EQ(base.size(), 16u);
  c.paths = {b};
  EXPECT_EQ(Dataset::open(c, 100)->digest(), base) << "the same samples elsewhere";
  c.seed = 1;
  EXPECT_NE(Dataset::open(c, 100)->digest(), base) << "another order";
  c.seed = 0;
  c.eval_fraction = 0.5;
  EXPECT_NE(Dataset::open(c, 100)->digest(), base) << "samples held out";
  c.eval_fraction = 0;
  std::ofstream(b + "/y.jsonl", std::ios::trunc) << "{\"input_ids\": [1,2,3,4], \"loss_mask\": [0,0,1,1]}\n"
                                                 << lines.substr(lines.find('\n') + 1);
  const std::string masked = Dataset::open(c, 100)->digest();
  EXPECT_NE(masked, base) << "another loss mask";
  c.max_length = 3;
  EXPECT_NE(Dataset::open(c, 100)->digest(), masked) << "truncated otherwise";
}

// A sample is read again each time it is trained on: one whose file changed in place since the
// data was indexed (the same line lengths, other tokens) is refused, not trained on silently.
TEST(Dataset, ASampleChangedSinceIndexingIsRefusedWhenRead) {
  const std::string dir = test::make_temp_dir("changed");
  std::ofstream(dir + "/a.jsonl") << "{\"input_ids\": [1,2,3,4], \"loss_mask\": [0,1,1,1]}\n"
                                     "{\"input_ids\": [5,6,7,8], \"loss_mask\": [1,1,1,1]}\n";
  config::DataConfig c;
  c.paths = {dir + "/a.jsonl"};
  c.shuffle = false;
  auto d = Dataset::open(c, 100);
  EXPECT_EQ(d->load(1).input_ids, (std::vector<int64_t>{5, 6, 7, 8}));
  std::ofstream(dir + "/a.jsonl", std::ios::trunc) << "{\"input_ids\": [1,2,3,4], \"loss_mask\": [0,1,1,1]}\n"
                                                      "{\"input_ids\": [5,6,7,9], \"loss_mask\": [1,1,1,1]}\n";
  EXPECT_EQ(d->load(0).input_ids, (std::vector<int64_t>{1, 2, 3, 4})) << "an unchanged line reads as before";
  try {
    d->load(1);
    ADD_FAILURE() << "a changed sample was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/a.jsonl:2: changed since the data was indexed at start"),
              std::string::npos)
        << e.what();
  }
}

TEST(BoundedQueue, BoundsBlocksProducersAndDrainsOnClose) {
  BoundedQueue<int> q(2);
  EXPECT_TRUE(q.push(1));
  EXPECT_TRUE(q.push(2));
  std::atomic<bool> third_done{false};
  std::thread producer([&] {
    q.push(3);
    third_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_FALSE(third_done.load()) << "a full queue blocks its producer";
  EXPECT_EQ(q.depth(), 2);
  EXPECT_EQ(*q.pop(), 1);
  producer.join();
  EXPECT_TRUE(third_done.load());
  EXPECT_GT(q.producer_blocked_seconds(), 0.1);
  q.close();
  EXPECT_FALSE(q.push(4));
  // FIFO per producer only (moodycamel): 2 and 3 came from different threads.
  std::set<int> rest{*q.pop(), *q.pop()};
  EXPECT_EQ(rest, (std::set<int>{2, 3}));
  EXPECT_FALSE(q.pop().has_value());
}

TEST(NcclGradients, SumsAcrossTheGpusOfThisProcess) {
  const int gpus = at::detail::getCUDAHooks().isBuilt() && at::hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  if (gpus == 0 || !NcclGradients::available()) GTEST_SKIP() << "needs a CUDA GPU and NCCL";
  std::vector<int> devices;
  for (int d = 0; d < gpus; ++d) devices.push_back(d);
  NcclGradients nccl(devices, nullptr);
  std::vector<std::vector<at::Tensor>> grads(gpus);
  std::vector<std::thread> threads;
  for (int r = 0; r < gpus; ++r) {
    const auto options = at::TensorOptions().device(at::kCUDA, r);
    grads[r] = {at::full({3, 5}, r + 1.0, options.dtype(at::kBFloat16)), at::full({7}, 2.0 * (r + 1), options.dtype(at::kFloat))};
    threads.emplace_back([&, r] { nccl.sum(r, grads[r]); });
  }
  for (auto& t : threads) t.join();
  const double total = gpus * (gpus + 1) / 2.0;
  for (int r = 0; r < gpus; ++r) {
    EXPECT_EQ(grads[r][0].scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::allclose(grads[r][0].to(at::kFloat).cpu(), at::full({3, 5}, total)));
    EXPECT_TRUE(at::allclose(grads[r][1].cpu(), at::full({7}, 2 * total)));
  }
}

// A failed run aborts the communicators: later sums throw instead of waiting for a peer, and
// the destructor destroys nothing twice.
TEST(NcclGradients, AbortMakesLaterSumsThrow) {
  const int gpus = at::detail::getCUDAHooks().isBuilt() && at::hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  if (gpus == 0 || !NcclGradients::available()) GTEST_SKIP() << "needs a CUDA GPU and NCCL";
  NcclGradients nccl({0}, nullptr);
  std::vector<at::Tensor> grads{at::ones({4}, at::TensorOptions().device(at::kCUDA, 0))};
  nccl.sum(0, grads);
  nccl.abort();
  nccl.abort();  // once is enough; again is harmless
  EXPECT_THROW(nccl.sum(0, grads), std::runtime_error);
}

TEST(StageClock, AttributesTimeToStagesPerIterationOnTheCpu) {
  StageClock clock(at::kCPU);
  for (int i = 0; i < 3; ++i) {
    clock.start();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    clock.lap("slow");
    clock.lap("instant");
  }
  const auto totals = clock.totals();
  EXPECT_EQ(clock.iterations(), 3);
  EXPECT_GE(totals.at("slow"), 0.055);
  EXPECT_LT(totals.at("instant"), totals.at("slow") / 10);
  // A GPU turn without a shared GPU is a no-op, and a null ready event is waited for at once.
  { const GpuTurn turn(nullptr, at::kCPU); }
  wait_ready(mark_ready(at::kCPU), {at::zeros({2})});
}

// ---- The real binary --------------------------------------------------------------------------

using test::drafter_checkpoints;
using test::exists;
using test::final_weights;
using test::make_run;
using test::RunDir;

TEST(PipelineRun, TrainsToTheEndCheckpointsAndExports) {
  const RunDir r = make_run("run", "train: {max_steps: 24, learning_rate: 0.003, deterministic: true}\n"
                                "checkpoint: {every_steps: 10, keep_last: 2}\n");
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  ASSERT_EQ(p.wait(120000), 0) << p.err();
  EXPECT_NE(p.err().find("run finished at step 24"), std::string::npos) << p.err();
  EXPECT_TRUE(exists(r.dir + "/out/export/final/model.safetensors"));
  EXPECT_TRUE(exists(r.dir + "/out/export/final/config.json"));
  EXPECT_TRUE(exists(r.dir + "/out/checkpoints/step-000000000024/COMMIT"));
  EXPECT_TRUE(exists(r.dir + "/out/checkpoints/step-000000000020/COMMIT"));
  EXPECT_FALSE(exists(r.dir + "/out/checkpoints/step-000000000010")) << "keep_last 2";
  // `dflashd export` of the last checkpoint gives the same files as the run's final export.
  test::Process exported({kBinary, "export", r.dir + "/out/checkpoints/step-000000000024", r.dir + "/exported"}, {}, r.dir);
  ASSERT_EQ(exported.wait(60000), 0) << exported.err();
  EXPECT_EQ(test::read_file(r.dir + "/exported/model.safetensors"), test::read_file(r.dir + "/out/export/final/model.safetensors"));
  EXPECT_EQ(test::read_file(r.dir + "/exported/config.json"), test::read_file(r.dir + "/out/export/final/config.json"));
  test::Process bad({kBinary, "export", r.dir + "/out", r.dir + "/nothing"}, {}, r.dir);
  EXPECT_EQ(bad.wait(60000), 1);
  EXPECT_NE(bad.err().find("not a complete checkpoint (no COMMIT marker)"), std::string::npos) << bad.err();
  // Running again resumes at the end and does nothing more.
  test::Process again({kBinary, "run", "-c", r.config}, {}, r.dir);
  ASSERT_EQ(again.wait(60000), 0) << again.err();
  EXPECT_NE(again.err().find("the plan is already complete (step 24 of 24)"), std::string::npos) << again.err();
  // Other samples, as many of them: resuming would not be exact, and is refused.
  set_section(r, "data", "data: {synthetic: {sequences: 64, min_length: 24, max_length: 47}}");
  test::Process changed({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_EQ(changed.wait(60000), 4);
  EXPECT_NE(changed.err().find("step-000000000024: the training data changed since this checkpoint (data digest "),
            std::string::npos)
      << changed.err();
  // Other training settings resume, and the log says which differ from the run that wrote it.
  set_section(r, "data", "data: {synthetic: {sequences: 64, min_length: 24, max_length: 48}}");
  set_section(r, "train", "train: {max_steps: 24, learning_rate: 0.002, deterministic: true}");
  test::Process relearned({kBinary, "run", "-c", r.config}, {}, r.dir);
  ASSERT_EQ(relearned.wait(60000), 0) << relearned.err();
  EXPECT_NE(relearned.err().find("step-000000000024 with other settings than the run that wrote it: "
                                 "train.learning_rate: then 0.003, now 0.002"),
            std::string::npos)
      << relearned.err();
}

TEST(PipelineRun, SigkillAndResumeIsBitIdenticalAtSeveralKillPoints) {
  const std::string extra = "train: {max_steps: 40, deterministic: true}\ncheckpoint: {every_steps: 3, keep_last: 3}\n";
  const RunDir straight = make_run("straight", extra);
  test::Process p({kBinary, "run", "-c", straight.config}, {}, straight.dir);
  ASSERT_EQ(p.wait(120000), 0) << p.err();
  const std::string reference = final_weights(straight, "000000000040");
  ASSERT_FALSE(reference.empty());

  const RunDir killed = make_run("killed", extra);
  // Kill points: right after a checkpoint commits, between checkpoints, and very early.
  const std::vector<std::string> wait_for{"step-000000000006/COMMIT", "step-000000000015/COMMIT", ""};
  const std::vector<int> extra_delay_ms{0, 170, 40};
  for (size_t k = 0; k < wait_for.size(); ++k) {
    test::Process run({kBinary, "run", "-c", killed.config}, {}, killed.dir);
    if (!wait_for[k].empty()) {
      for (int i = 0; i < 600 && !exists(killed.dir + "/out/checkpoints/" + wait_for[k]); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(extra_delay_ms[k]));
    run.signal(SIGKILL);
    EXPECT_EQ(run.wait(), 128 + SIGKILL);
  }
  test::Process finish({kBinary, "run", "-c", killed.config}, {}, killed.dir);
  ASSERT_EQ(finish.wait(120000), 0) << finish.err();
  EXPECT_NE(finish.err().find("resuming from"), std::string::npos) << finish.err();
  EXPECT_TRUE(final_weights(killed, "000000000040") == reference) << "resumed run differs from the uninterrupted one";
}

// Data parallelism: two drafter replicas (and two target replicas) with one sequence each per
// step train the same model as one replica accumulating two micro-steps: the same samples, the
// same global loss denominator, gradients summed across replicas instead of across micro-steps.
TEST(PipelineRun, TwoReplicasMatchOneReplicaWithAccumulation) {
  const std::string common = "checkpoint: {every_steps: 1000}\n";
  const RunDir two = make_run("dp-two", common + "gpus: {device: cpu, target: [0, 1], drafter: [0, 1]}\n"
                                                 "train: {max_steps: 12, learning_rate: 0.003}\n");
  const RunDir one = make_run("dp-one", common + "train: {max_steps: 12, learning_rate: 0.003, grad_accumulation_steps: 2}\n");
  // make_run writes gpus: {device: cpu}; the later key of the same name would be a duplicate,
  // so drop the default line from the two-replica config.
  std::string text = test::read_file(two.config);
  text.erase(text.find("gpus: {device: cpu}\n"), std::string("gpus: {device: cpu}\n").size());
  std::ofstream(two.config, std::ios::trunc) << text;
  test::Process a({kBinary, "run", "-c", two.config}, {}, two.dir);
  test::Process b({kBinary, "run", "-c", one.config}, {}, one.dir);
  ASSERT_EQ(a.wait(180000), 0) << a.err();
  ASSERT_EQ(b.wait(180000), 0) << b.err();
  EXPECT_NE(a.err().find("global batch 2 sequences on 2 drafter replica(s)"), std::string::npos) << a.err();
  EXPECT_NE(b.err().find("global batch 2 sequences on 1 drafter replica(s)"), std::string::npos) << b.err();
  const std::string wa = final_weights(two, "000000000012"), wb = final_weights(one, "000000000012");
  ASSERT_EQ(wa.size(), wb.size());
  ASSERT_GT(wa.size(), 4096u);
  // Compare the fp32 payloads (after the identical headers) with a relative tolerance: the
  // summation order of the gradients differs.
  const size_t header = 8 + *reinterpret_cast<const uint64_t*>(wa.data());
  const float* x = reinterpret_cast<const float*>(wa.data() + header);
  const float* y = reinterpret_cast<const float*>(wb.data() + header);
  const size_t n = (wa.size() - header) / 4;
  double worst = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(x[i] - y[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(y[i])));
  }
  EXPECT_LE(worst / scale, 1e-4) << "max abs diff " << worst;
}

// data.max_length past the target's context (its config.json's max_position_embeddings) is a
// validate error and refuses the run, naming both.
TEST(PipelineRun, SequencesPastTheTargetsContextAreRefused) {
  const RunDir r = make_run("context");
  std::string json = target::preset_config_json("tiny-qwen3");
  json.insert(json.rfind('}'), R"(, "max_position_embeddings": 32)");
  std::filesystem::create_directories(r.dir + "/target");
  std::ofstream(r.dir + "/target/config.json") << json;
  set_section(r, "target", "target: {path: " + r.dir + "/target, weights: random, dtype: float32}");
  const std::string validate = kBinary + " validate --offline -c " + r.config + " > " + r.dir + "/v.log 2>&1";
  EXPECT_NE(std::system(validate.c_str()), 0);
  EXPECT_NE(test::read_file(r.dir + "/v.log").find("data.max_length 3072 is past the target's context (" + r.dir +
                                                   "/target/config.json: max_position_embeddings 32)"),
            std::string::npos)
      << test::read_file(r.dir + "/v.log");
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_NE(p.wait(60000), 0);
  EXPECT_NE(p.err().find("is past the target's context"), std::string::npos) << p.err();
}

// A target replica in pipeline stages (gpus.target: [[0, 1, 2]], three stages on the CPU)
// feeds the drafter the same features as one whole target: the trained drafter is bit-identical.
TEST(PipelineRun, ATargetInStagesTrainsTheSameDrafterAsOneTarget) {
  const std::string common = "checkpoint: {every_steps: 1000}\ntrain: {max_steps: 6, learning_rate: 0.003}\n";
  const RunDir staged = make_run("staged", common);
  const RunDir whole = make_run("whole", common);
  std::string text = test::read_file(staged.config);
  text.replace(text.find("gpus: {device: cpu}"), std::string("gpus: {device: cpu}").size(),
               "gpus: {device: cpu, target: [[0, 1, 2]], drafter: [0]}");
  std::ofstream(staged.config, std::ios::trunc) << text;
  test::Process a({kBinary, "run", "-c", staged.config}, {}, staged.dir);
  test::Process b({kBinary, "run", "-c", whole.config}, {}, whole.dir);
  ASSERT_EQ(a.wait(180000), 0) << a.err();
  ASSERT_EQ(b.wait(180000), 0) << b.err();
  EXPECT_NE(a.err().find("target stage 2: layers"), std::string::npos) << a.err();
  EXPECT_EQ(final_weights(staged, "000000000006"), final_weights(whole, "000000000006"));
  // validate's memory plan shows each stage's layers on its GPU.
  const std::string validate = kBinary + " validate --offline -c " + staged.config + " > " + staged.dir + "/v.log 2>&1";
  ASSERT_EQ(std::system(validate.c_str()), 0) << test::read_file(staged.dir + "/v.log");
  EXPECT_NE(test::read_file(staged.dir + "/v.log").find("target L0-"), std::string::npos)
      << test::read_file(staged.dir + "/v.log");
}

// Multi-node: two processes (nodes) with one drafter replica each, meeting through the TCP
// store (node 1 reads torchrun's variables), train bit-for-bit the drafter of one process
// with two replicas: same samples per replica, same sums in the same order.
TEST(PipelineRun, TwoNodesTrainTheSameDrafterAsOneNodeWithTwoReplicas) {
  const std::string common = "checkpoint: {every_steps: 1000}\ntrain: {max_steps: 8, learning_rate: 0.003}\n";
  const int port = test::free_port();
  const RunDir node0 = make_run("node0", common + "distributed: {nodes: 2, node_rank: 0, master_port: " +
                                             std::to_string(port) + ", timeout_seconds: 60}\n");
  const RunDir node1 = make_run("node1", common + "distributed: {from_env: true, timeout_seconds: 60}\n");
  const RunDir single = make_run("single", common);
  std::string text = test::read_file(single.config);
  text.replace(text.find("gpus: {device: cpu}"), std::string("gpus: {device: cpu}").size(),
               "gpus: {device: cpu, target: [0, 1], drafter: [0, 1]}");
  std::ofstream(single.config, std::ios::trunc) << text;
  test::Process a({kBinary, "run", "-c", node0.config}, {}, node0.dir);
  test::Process b({kBinary, "run", "-c", node1.config},
                  {"WORLD_SIZE=2", "RANK=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)}, node1.dir);
  test::Process c({kBinary, "run", "-c", single.config}, {}, single.dir);
  ASSERT_EQ(a.wait(180000), 0) << a.err();
  ASSERT_EQ(b.wait(180000), 0) << b.err();
  ASSERT_EQ(c.wait(180000), 0) << c.err();
  EXPECT_NE(a.err().find("all 2 nodes joined"), std::string::npos) << a.err();
  EXPECT_NE(b.err().find("node 1 of 2"), std::string::npos) << b.err();
  const std::string w0 = final_weights(node0, "000000000008"), w1 = final_weights(node1, "000000000008");
  ASSERT_GT(w0.size(), 4096u);
  EXPECT_TRUE(w0 == w1) << "the nodes ended with different drafters";
  EXPECT_TRUE(w0 == final_weights(single, "000000000008")) << "two nodes differ from one node with two replicas";
}

// A SIGTERM on one node stops every node at the same step; a restart where one node lost its
// checkpoints is refused on every node with the reason.
TEST(PipelineRun, OneNodeStoppedStopsAllAtOneStepAndResumeMustAgree) {
  const int port = test::free_port();
  auto node = [&](int rank) {
    return make_run("stop" + std::to_string(rank), "checkpoint: {every_steps: 100000}\ntrain: {max_steps: 100000}\n"
                                                    "distributed: {nodes: 2, node_rank: " + std::to_string(rank) +
                                                    ", master_port: " + std::to_string(port) + ", timeout_seconds: 60}\n");
  };
  const RunDir n0 = node(0), n1 = node(1);
  {
    test::Process a({kBinary, "run", "-c", n0.config}, {}, n0.dir);
    test::Process b({kBinary, "run", "-c", n1.config}, {}, n1.dir);
    for (int i = 0; i < 600 && b.err().find("step ") == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    b.signal(SIGTERM);
    ASSERT_EQ(b.wait(60000), 0) << b.err();
    ASSERT_EQ(a.wait(60000), 0) << a.err();
    const auto c0 = drafter_checkpoints(n0), c1 = drafter_checkpoints(n1);
    ASSERT_EQ(c0.size(), 1u);
    EXPECT_EQ(c0, c1) << "the nodes stopped at different steps";
    ASSERT_EQ(std::system(("rm -rf " + n1.dir + "/out/checkpoints").c_str()), 0);
  }
  test::Process a({kBinary, "run", "-c", n0.config}, {}, n0.dir);
  test::Process b({kBinary, "run", "-c", n1.config}, {}, n1.dir);
  EXPECT_NE(a.wait(60000), 0);
  EXPECT_NE(b.wait(60000), 0);
  for (const test::Process* p : {&a, &b}) {
    EXPECT_NE(p->err().find("the nodes would resume from different steps"), std::string::npos) << p->err();
  }
}

// Each node reads its own copy of the data and its own config: nodes whose data differ, or whose
// steps would differ (a setting of the train section, the drafter's shape, drafter GPUs per node),
// are refused on every node before any step, the message naming what differs and each node's value.
TEST(PipelineRun, NodesWithDifferentDataOrTrainingSettingsAreRefused) {
  struct Case {
    std::string node1_section, message;
  };
  const std::vector<Case> cases{
      {"data: {synthetic: {sequences: 64, min_length: 24, max_length: 47}}",
       "distributed: the nodes read different training data (data digest: node 0 \""},
      {"train: {max_steps: 4, learning_rate: 0.001}",
       "distributed: the nodes would train differently (train.learning_rate: node 0 0.0006, node 1 0.001); give "
       "every node the same drafter and train sections"},
      {"gpus: {device: cpu, target: [0], drafter: [0, 1]}",
       "(gpus.drafter (replicas per node): node 0 1, node 1 2)"}};
  for (const Case& c : cases) {
    const int port = test::free_port();
    auto node = [&](int rank) {
      return make_run("agree" + std::to_string(rank), "train: {max_steps: 4}\ndistributed: {nodes: 2, node_rank: " +
                                                          std::to_string(rank) + ", master_port: " +
                                                          std::to_string(port) + ", timeout_seconds: 60}\n");
    };
    const RunDir n0 = node(0), n1 = node(1);
    set_section(n1, c.node1_section.substr(0, c.node1_section.find(':')), c.node1_section);
    test::Process a({kBinary, "run", "-c", n0.config}, {}, n0.dir);
    test::Process b({kBinary, "run", "-c", n1.config}, {}, n1.dir);
    EXPECT_EQ(a.wait(60000), 4) << c.node1_section;
    EXPECT_EQ(b.wait(60000), 4) << c.node1_section;
    for (const test::Process* p : {&a, &b}) {
      EXPECT_NE(p->err().find(c.message), std::string::npos) << p->err();
      EXPECT_EQ(p->err().find("step 1"), std::string::npos) << p->err();
    }
  }
}

// One dflashd per output directory (and per checkpoint directory elsewhere): a second process is
// refused at start, naming the holder; the lock goes with the process that held it.
TEST(PipelineRun, ASecondProcessOnTheSameDirectoriesIsRefused) {
  const RunDir r = make_run("locked", "train: {max_steps: 2}\n");
  {
    const DirectoryLock holder(r.dir + "/out", "the test's holder");
    test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
    EXPECT_EQ(p.wait(60000), 4);
    EXPECT_NE(p.err().find(r.dir + "/out is in use by the test's holder (pid " + std::to_string(::getpid()) + ")"),
              std::string::npos)
        << p.err();
  }
  set_section(r, "train", "train: {max_steps: 2}\ncheckpoint: {dir: " + r.dir + "/elsewhere}");
  {
    const DirectoryLock holder(r.dir + "/elsewhere", "the test's holder");
    test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
    EXPECT_EQ(p.wait(60000), 4);
    EXPECT_NE(p.err().find(r.dir + "/elsewhere is in use by the test's holder"), std::string::npos) << p.err();
  }
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_EQ(p.wait(60000), 0) << p.err();
}

TEST(PipelineRun, TorchrunVariablesMissingAreNamed) {
  const RunDir r = make_run("noenv", "distributed: {from_env: true}\ntrain: {max_steps: 2}\n");
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_NE(p.wait(60000), 0);
  EXPECT_NE(p.err().find("the environment variable WORLD_SIZE is not set"), std::string::npos) << p.err();
  test::Process q({kBinary, "run", "-c", r.config}, {"WORLD_SIZE=2", "RANK=two", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=1"},
                  r.dir);
  EXPECT_NE(q.wait(60000), 0);
  EXPECT_NE(q.err().find("RANK='two' is not an integer in 0..1"), std::string::npos) << q.err();
}

TEST(PipelineRun, SigtermFinishesTheStepCheckpointsAndExitsZero) {
  const RunDir r = make_run("sigterm", "train: {max_steps: 100000}\ncheckpoint: {every_steps: 100000}\n");
  test::NotifySocket notify;
  test::Process p({kBinary, "run", "-c", r.config}, {"NOTIFY_SOCKET=" + notify.path()}, r.dir);
  ASSERT_NE(notify.wait_for("READY=1", 60000), "");
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  p.signal(SIGTERM);
  EXPECT_NE(notify.wait_for("STOPPING=1", 30000), "");
  ASSERT_EQ(p.wait(60000), 0) << p.err();
  EXPECT_NE(p.err().find("stopped cleanly at step"), std::string::npos) << p.err();
  EXPECT_FALSE(drafter_checkpoints(r).empty());
}

TEST(PipelineRun, WorkerFailureStopsWithReasonOrIsRetried) {
  // The shipped binary reads no fault injection from its environment.
  const RunDir shipped = make_run("fail-shipped", "train: {max_steps: 10}\n");
  test::Process s({kBinary, "run", "-c", shipped.config}, {"DFLASHD_TEST_FAULT=target:5:always"}, shipped.dir);
  EXPECT_EQ(s.wait(120000), 0) << s.err();
  EXPECT_EQ(s.err().find("injected fault"), std::string::npos) << s.err();

  const RunDir stop = make_run("fail-stop", "train: {max_steps: 30}\n");
  test::Process p({kFaulty, "run", "-c", stop.config}, {"DFLASHD_TEST_FAULT=target:5"}, stop.dir);
  EXPECT_EQ(p.wait(120000), 1) << p.err();
  EXPECT_NE(p.err().find("target-0 failed on sample 5: injected fault"), std::string::npos) << p.err();
  EXPECT_NE(p.err().find("run failed at step"), std::string::npos) << p.err();

  const RunDir retry = make_run("fail-retry", "train: {max_steps: 30}\nworkers: {on_failure: restart, max_restarts: 2}\n");
  test::Process q({kFaulty, "run", "-c", retry.config}, {"DFLASHD_TEST_FAULT=target:5"}, retry.dir);
  EXPECT_EQ(q.wait(120000), 0) << q.err();
  EXPECT_NE(q.err().find("retrying (1 of 2)"), std::string::npos) << q.err();

  const RunDir exhausted = make_run("fail-exhausted", "train: {max_steps: 30}\n"
                                                     "workers: {on_failure: restart, max_restarts: 2, skip_sample_after_failures: 0}\n");
  test::Process x({kFaulty, "run", "-c", exhausted.config}, {"DFLASHD_TEST_FAULT=target:5:always"}, exhausted.dir);
  EXPECT_EQ(x.wait(120000), 1) << x.err();
  EXPECT_NE(x.err().find("(restarts exhausted)"), std::string::npos) << x.err();
}

// drafter.attention: auto refuses to fall back from the fused kernels on a GPU (here: fp32, which
// they do not take), naming the fix; asking for the split path explicitly runs.
TEST(PipelineRun, GpuAttentionFallbackIsRefusedUnlessAsked) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const RunDir r = make_run("gpu-attention", "train: {max_steps: 2}\n");
  test::set_section(r, "gpus", "gpus: {device: cuda, target: [0], drafter: [0]}");
  test::set_section(r, "target", "target: {preset: tiny-qwen3, weights: random, dtype: float32}");
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_EQ(p.wait(120000), 4) << p.err();
  EXPECT_NE(p.err().find("drafter.attention on GPU 0 would run the split path"), std::string::npos)
      << p.err();
  EXPECT_NE(p.err().find("set drafter.attention: efficient"), std::string::npos) << p.err();
  std::string text = test::read_file(r.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {attention: math, ");
  std::ofstream(r.config) << text;
  test::Process q({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_EQ(q.wait(120000), 0) << q.err();
  EXPECT_NE(q.err().find("kernel path: drafter.attention: math (split path, portable math (as configured))"), std::string::npos) << q.err();
}

TEST(PipelineRun, MalformedDataLineIsAStartupErrorNamingFileAndLine) {
  const std::string dir = test::make_temp_dir("bad-data");
  std::ofstream(dir + "/train.jsonl") << "{\"input_ids\": [1,2,3,4], \"loss_mask\": [0,1,1,1]}\n{\"input_ids\": [1,2,\n";
  const RunDir r = make_run("bad-data-run");
  std::string text = test::read_file(r.config);
  text.replace(text.find("data: {synthetic: {sequences: 64, min_length: 24, max_length: 48}}"), 66,
               "data: {paths: [" + dir + "/train.jsonl]}");
  std::ofstream(r.config) << text;
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  EXPECT_EQ(p.wait(60000), 4) << p.err();
  EXPECT_NE(p.err().find(dir + "/train.jsonl:2: invalid JSON"), std::string::npos) << p.err();
}

TEST(PipelineRun, ScrapeDuringTrainingHasEveryPipelineMetric) {
  const int port = test::free_port();
  const RunDir r = make_run("scrape", "train: {max_steps: 100000}\n", port);
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  httplib::Client client("127.0.0.1", port);
  std::string body;
  for (int i = 0; i < 300; ++i) {
    auto response = client.Get("/metrics");
    if (response && response->body.find("dflashd_optimizer_steps_total 1") == std::string::npos &&
        response->body.find("\ndflashd_optimizer_steps_total ") != std::string::npos &&
        response->body.find("dflashd_loss ") != std::string::npos &&
        response->body.find("dflashd_tokens_per_second ") != std::string::npos) {
      body = response->body;
      if (body.find("dflashd_optimizer_steps_total 0\n") == std::string::npos &&
          body.find("dflashd_tokens_per_second 0\n") == std::string::npos) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (const char* name :
       {"dflashd_tokens_total", "dflashd_samples_total", "dflashd_tokens_per_second", "dflashd_eta_seconds",
        "dflashd_mfu_ratio", "dflashd_optimizer_steps_total", "dflashd_loss", "dflashd_position_accuracy{position=\"1\"}",
        "dflashd_expected_acceptance_length", "dflashd_learning_rate", "dflashd_grad_norm",
        "dflashd_nonfinite_steps_total", "dflashd_queue_depth{queue=\"samples\"}",
        "dflashd_queue_capacity{queue=\"features-0\"}", "dflashd_queue_producer_blocked_seconds_total",
        "dflashd_queue_consumer_starved_seconds_total", "dflashd_worker_last_heartbeat_timestamp_seconds{worker=\"drafter-0\"}",
        "dflashd_worker_restarts_total{worker=\"target-0\"}", "dflashd_worker_stalled", "dflashd_checkpoint_last_success_timestamp_seconds",
        "dflashd_checkpoint_duration_seconds", "dflashd_kernel_path{component=\"target.linear_attention\"",
        "dflashd_bottleneck{stage=\"target\"}", "dflashd_kernel_path{component=\"drafter.attention\",path=\"math\"} 1", "dflashd_suggested_target_gpus", "dflashd_samples_skipped_total",
        "dflashd_build_info", "process_resident_memory_bytes",
        "dflashd_stage_seconds_total{role=\"target\",stage=\"target_forward\"}",
        "dflashd_stage_seconds_total{role=\"drafter\",stage=\"backward\"}",
        "dflashd_stage_seconds_total{role=\"drafter\",stage=\"optimizer\"}"}) {
    EXPECT_NE(body.find(name), std::string::npos) << name << "\n" << body.substr(0, 3000);
  }
  // The log's stage line covers the interval since the previous one: each role's busy share and
  // its stages per iteration.
  std::string log;
  for (int i = 0; i < 100 && log.find("| drafter (busy ") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    log = p.err();
  }
  EXPECT_NE(log.find("by stage: target (busy "), std::string::npos) << log;
  EXPECT_NE(log.find(" target_forward "), std::string::npos) << log;
  EXPECT_NE(log.find("| drafter (busy "), std::string::npos) << log;
  EXPECT_NE(log.find("kernel path: drafter.attention: math (split path, portable math; the fused kernels do not run: "), std::string::npos) << log;
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(60000), 0) << p.err();
}

}  // namespace
}  // namespace dflash::pipeline
