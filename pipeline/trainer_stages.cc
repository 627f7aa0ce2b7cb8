// The pipeline's three stages (trainer.h's data flow), one loop per worker
// thread.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <deque>
#include <future>
#include <memory>
#include <optional>

#include "common/log.h"
#include "pipeline/trainer_impl.h"
#include "target/model.h"

namespace dflash::pipeline {
namespace {

// A replica's stage devices (one for a replica on one GPU), in ascending order.
std::vector<at::Device> devices_of(const target::StagedTarget &model) {
  std::vector<at::Device> devices;
  for (size_t s = 0; s < model.size(); ++s) {
    const at::Device d = model.stage(s).options().device;
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  }
  std::sort(devices.begin(), devices.end(), [](const at::Device &a, const at::Device &b) { return a.index() < b.index(); });
  return devices;
}

at::Tensor ids_of(const SampleItem &item) {
  return at::tensor(item.sample.input_ids, at::TensorOptions().dtype(at::kLong));
}

// The drafter's input on its GPU: the fc input is the tapped layers concatenated in ascending id
// order (docs/recipe.md), beside the sample's ids and loss mask; `ready` orders the copies.
void hand_off(const std::vector<at::Tensor> &tapped, const at::Tensor &ids, const SampleItem &item, at::Device to,
              FeatureItem *out) {
  out->features = at::cat(tapped, -1).to(to, /*non_blocking=*/false, /*copy=*/false);
  out->input_ids = ids.to(to);
  out->loss_mask = item.sample.loss_mask;
  out->ready = mark_ready(to);
}

}  // namespace

// ---- reader
// ----------------------------------------------------------------------------
void Trainer::Impl::reader_loop(Worker &w) {
  const int64_t first = plan.first_sample(start_step);
  const int64_t end = plan.end_sample(plan.total_steps - 1);
  for (int64_t q = first; q < end && !stop_requested.load(); ++q) {
    w.beat();
    if (plan.replica_of(q) / local_replicas != node_rank) continue;  // another node's sample
    SampleItem item;
    item.q = q;
    if (!failure_policy->run(w, "sample " + std::to_string(q), [&] { item.sample = data->load(data_index(q)); })) {
      return;
    }
    if (!sample_queue->push(std::move(item), [&] { w.beat(); })) return;
  }
}

// ---- target worker
// -----------------------------------------------------------------------
void Trainer::Impl::target_loop(Worker &w, size_t replica) {
  c10::InferenceMode inference;
  const target::StagedTarget &model = *models->targets[replica];
  // A worker stream on each of its stages' devices, and (one GPU) the shared GPU's turn.
  const std::vector<at::Device> devices = devices_of(model);
  std::vector<std::unique_ptr<WorkerStream>> streams;
  for (const at::Device &d : devices) streams.push_back(std::make_unique<WorkerStream>(d));
  StageClock &clock = *models->target_clocks[replica];
  const std::vector<int64_t> layers(shape.target_layer_ids.begin(), shape.target_layer_ids.end());
  // A replica in stages keeps one sequence per stage in flight (StagedTarget::submit: its stage
  // threads overlap them); a replica on one GPU runs each sequence in turn. Hand-offs keep the
  // sample order.
  struct InFlight {
    SampleItem item;
    std::optional<std::future<std::vector<at::Tensor>>> result;
  };
  std::deque<InFlight> in_flight;
  bool more = true;
  while (true) {
    while (more && in_flight.size() < model.size()) {
      auto item = sample_queue->pop([&] { w.beat(); });
      if (!item) {
        more = false;
        break;
      }
      InFlight f{std::move(*item), std::nullopt};
      if (model.size() > 1 && !failed_samples->skipped(data_index(f.item.q))) {
        const at::Tensor ids = ids_of(f.item);
        f.result = model.submit(ids, {0, ids.size(0)}, layers);
      }
      in_flight.push_back(std::move(f));
    }
    if (in_flight.empty()) return;
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    const SampleItem &item = f.item;
    w.beat();
    std::optional<GpuTurn> turn;  // released before the push: a full queue must not hold the GPU
    if (model.size() == 1) turn.emplace(models->turn_of(devices[0]), devices[0]);
    clock.start();
    const int64_t drafter_replica = plan.replica_of(item.q) - node_rank * local_replicas;  // local index
    FeatureItem out;
    out.q = item.q;
    const int64_t index = data_index(item.q);
    bool skipped = failed_samples->skipped(index);  // then `out` goes on without features
    const bool ok = skipped || failure_policy->run(
                                   w, "sample " + std::to_string(item.q),
                                   [&] {
                                     if (hooks.target_forward) hooks.target_forward(item.q);
                                     const at::Tensor ids = ids_of(item);
                                     std::vector<at::Tensor> tapped;
                                     if (f.result) {  // the staged forward started earlier (a retry runs it again)
                                       auto result = std::move(*f.result);
                                       f.result.reset();
                                       tapped = result.get();
                                     } else {
                                       tapped = model.forward(ids, {0, ids.size(0)}, layers);
                                     }
                                     clock.lap("target_forward");
                                     hand_off(tapped, ids, item, models->drafter_devices[drafter_replica], &out);
                                     clock.lap("feature_handoff");
                                   },
                                   {index}, &skipped);
    if (skipped) {
      out = FeatureItem{};  // no features: the drafter leaves the sample out
      out.q = item.q;
    }
    if (!ok) return;
    turn.reset();
    if (!feature_queues[drafter_replica]->push(std::move(out), [&] { w.beat(); })) return;
  }
}

// ---- drafter worker
// ----------------------------------------------------------------------
void Trainer::Impl::drafter_loop(Worker &w, int replica) {
  BoundedQueue<FeatureItem> &queue = *feature_queues[replica];
  const WorkerStream stream(models->drafter_devices[replica]);
  std::map<int64_t, FeatureItem> waiting;  // reorder buffer: items arrive in any order
  for (int64_t step = start_step; step < plan.total_steps; ++step) {
    w.beat();
    // Every replica agrees to stop at the same step boundary.
    if (collective->sum(replica, stop_requested.load() ? 1.0 : 0.0) > 0) return;
    const std::vector<int64_t> wanted = plan.samples_for(step, node_rank * local_replicas + replica);
    for (int64_t q : wanted) {
      while (!waiting.count(q)) {
        auto item = queue.pop([&] { w.beat(); });
        if (!item) return;  // closed: the run is stopping or failed
        wait_ready(item->ready, {item->features, item->input_ids});
        waiting.emplace(item->q, std::move(*item));
      }
    }
    StepOutput out;
    std::vector<int64_t> indices;  // the step's samples in data order, for FailedSamples
    for (int64_t q : wanted) indices.push_back(data_index(q));
    const bool ok = failure_policy->run(
        w, "step " + std::to_string(step),
        [&] {
          // A retried step starts from clean gradients. With several replicas a
          // retry would put this replica out of step with the others'
          // collectives, so failures stop the run instead.
          if (w.restarts.load() > 0 && plan.replicas > 1) {
            throw std::runtime_error(
                "a drafter step cannot be retried with "
                "several data-parallel replicas");
          }
          std::vector<StepSample> samples;
          for (int64_t q : wanted) {
            const FeatureItem &item = waiting.at(q);
            if (item.skipped() || failed_samples->skipped(data_index(q))) continue;
            samples.push_back({q, item.features, item.input_ids, &item.loss_mask});
          }
          out = drafter_step(models->drafter[replica], step_settings, samples, *collective, [&] {
            if (hooks.drafter_step) hooks.drafter_step(replica, step);
          });
        },
        indices);
    if (!ok) return;
    for (int64_t q : wanted) waiting.erase(q);
    if (!out.result.applied) {
      metrics->nonfinite_total->Increment();
      const std::string message =
          "non-finite gradient (norm " + std::to_string(out.result.grad_norm) + ") at step " + std::to_string(step);
      if (config.train.on_nonfinite == config::OnNonfinite::stop) {
        if (replica == 0) fail(message + "; stopping (train.on_nonfinite: stop)");
        return;
      }
      log::warn("{}: step skipped", message);
    }
    if (out.empty && replica == 0) {
      metrics->empty_steps_total->Increment();
      log::warn(
          "step {}: none of its samples has a block to train (every one "
          "was skipped or has no anchor): "
          "no update",
          step);
    }
    completed_step.store(step + 1);
    if (replica != 0) continue;
    metrics->record_step({step, out.stats.weight_sum > 0 ? out.stats.loss_sum / out.stats.weight_sum : 0,
                          out.stats.tau(), out.result.learning_rate, out.result.grad_norm, out.stats.accuracy(),
                          out.tokens, static_cast<int64_t>(wanted.size()) * plan.replicas, out.flops});
    checkpoints->maybe_checkpoint(step + 1, false, *models->drafters[0], *models->optimizers[0]);
    if (evaluator) evaluator->maybe_start(step + 1, *models->drafters[0]);
  }
}

}  // namespace dflash::pipeline
