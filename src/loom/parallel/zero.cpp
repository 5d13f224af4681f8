#include "loom/parallel/zero.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/pages.h"

namespace loom {

ShardRange shard_range(int64_t total, int rank, int world) {
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " outside a world of ", world);
  ShardRange r;
  r.shard = (total + world - 1) / world;
  r.begin = std::min(total, rank * r.shard);
  r.end = std::min(total, r.begin + r.shard);
  return r;
}

std::vector<int64_t> shard_counts(int64_t begin, int64_t end, int64_t total, int world) {
  std::vector<int64_t> counts;
  shard_counts(begin, end, total, world, counts);
  return counts;
}

void shard_counts(int64_t begin, int64_t end, int64_t total, int world, std::vector<int64_t>& counts) {
  counts.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const ShardRange s = shard_range(total, r, world);
    counts[static_cast<size_t>(r)] = std::max<int64_t>(0, std::min(end, s.end) - std::max(begin, s.begin));
  }
}

std::vector<OptimParam> shard_optim_params(const std::vector<OptimParam>& list, int64_t begin, int64_t end) {
  std::vector<OptimParam> out;
  for (const OptimParam& q : list) {
    const int64_t lo = std::max(begin, q.offset), hi = std::min(end, q.offset + q.numel);
    if (lo >= hi) continue;
    OptimParam p = q;
    p.offset = lo, p.numel = hi - lo;
    p.matrix = p.hidden = false;
    p.segments = {OptimSegment{lo, 1, hi - lo, 1}};
    out.push_back(std::move(p));
  }
  return out;
}

ZeroSharding::ZeroSharding(Communicator& comm, Backend& backend, int stage, const Tensor& params, const Tensor& grads,
                           std::vector<RangeSet> units, RangeSet domain, int64_t frozen_end)
    : comm_(comm),
      backend_(backend),
      stage_(stage),
      params_(params),
      grads_(grads),
      units_(std::move(units)),
      domain_(domain.empty() ? RangeSet::span(0, params.numel()) : std::move(domain)),
      domain_total_(domain_.size()),
      range_(shard_range(domain_total_, comm.rank(), comm.size())),
      total_(params.numel()),
      frozen_end_(frozen_end),
      gathering_(units_.size()),
      resident_(units_.size(), false) {
  LOOM_CHECK(stage_ >= 1 && stage_ <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ", stage_);
  LOOM_CHECK(params.dtype() == DTYPE_F32 && grads.dtype() == DTYPE_F32 && grads.numel() == total_,
             "ZeRO: parameter and gradient buffers ", params.describe(), ", ", grads.describe(), " must be f32 of one size");
  for (const Range& r : domain_) {
    LOOM_CHECK(r.begin >= 0 && r.begin <= r.end && r.end <= total_, "ZeRO: domain range [", r.begin, ", ", r.end,
               ") outside the ", total_, " parameters");
  }
  LOOM_CHECK(stage_ == 1 || domain_ == RangeSet::span(0, total_),
             "parallel.zero_stage = ", stage_, " shards the whole model; with parallel.pp > 1 use zero_stage 1");
  LOOM_CHECK(frozen_end_ >= 0 && frozen_end_ <= total_ && (frozen_end_ == 0 || stage_ >= 2), "ZeRO: frozen range [0, ",
             frozen_end_, ") of ", total_, " parameters (stages 2 and 3 only; stage 1 leaves it out of its domain)");
  reduced_from_ = total_;
  if (stage_ >= 2) zero_grads();
  if (stage_ == 3) release_params();
}

std::vector<int64_t> ZeroSharding::state_counts() const {
  return frozen_end_ > 0 ? shard_counts(frozen_end_, total_, total_, comm_.size())
                         : shard_counts(0, domain_total_, domain_total_, comm_.size());
}

void ZeroSharding::release(const Tensor& t, int64_t begin, int64_t end) {
  if (begin >= end) return;
  // Host memory: its pages go back to the OS (and read as zeros). A device's memory is not
  // paged by the host: the elements are zeroed through the backend, the same values.
  if (t.host_accessible()) release_elements(t, begin, end);
  else backend_.fill(t.view(begin, {end - begin}), 0.0);
}

void ZeroSharding::release_outside_shard(const Tensor& t, Range r) {
  release(t, r.begin, std::max(r.begin, std::min(r.end, range_.begin)));
  release(t, std::min(r.end, std::max(r.begin, range_.end)), r.end);
}

void ZeroSharding::gather_params() {
  if (stage_ == 3) {
    if (whole_) return;
    for (size_t u = 0; u < units_.size(); ++u) complete(gathering_[u], 0, false);
    whole_ = true;
  }
  if (stage_ == 2 && frozen_end_ > 0) {  // over a frozen base (held whole): only the updated elements changed
    shard_counts(frozen_end_, total_, total_, comm_.size(), counts_);
    comm_.all_gather_v_async(params_.view(frozen_end_, {total_ - frozen_end_}), counts_)->wait();
    return;
  }
  int64_t at = 0;
  for (const Range& r : domain_) {  // one in-place gather per domain range
    const int64_t n = r.end - r.begin;
    if (n > 0) {
      shard_counts(at, at + n, domain_total_, comm_.size(), counts_);
      gathers_.push_back(comm_.all_gather_v_async(params_.view(r.begin, {n}), counts_));
    }
    at += n;
  }
  for (auto& w : gathers_) w->wait();
  gathers_.clear();
}

void ZeroSharding::zero_grads() {
  finish_micro();
  release_outside_shard(grads_, {0, total_});
  const Range g = grad_shard();
  release(grads_, range_.begin, g.begin);  // the shard's frozen part has no gradients
  if (g.end > g.begin) backend_.fill(grads_.view(g.begin, {g.end - g.begin}), 0.0);
  reduced_from_ = total_;
}

void ZeroSharding::complete(PendingQueue& q, size_t keep, bool release_grads) {
  while (q.size() > keep) {
    q.front().work->wait();
    if (release_grads) release_outside_shard(grads_, q.front().range);
    q.pop_front();
  }
}

void ZeroSharding::reduce_from(int64_t offset) {
  offset = std::max(offset, frozen_end_);  // nothing below a frozen end is ever reduced
  LOOM_CHECK(offset <= reduced_from_, "ZeRO: backward reported offset ", offset, " after ", reduced_from_);
  if (offset == reduced_from_) return;
  const Range r{offset, reduced_from_};
  reduced_from_ = offset;
  shard_counts(r.begin, r.end, total_, comm_.size(), counts_);
  reducing_.push_back({comm_.reduce_scatter_v_async(grads_.view(r.begin, {r.end - r.begin}), counts_, REDUCE_SUM), r});
  complete(reducing_, 2, true);  // at most two layers' gradients in flight
}

void ZeroSharding::finish_micro() {
  complete(reducing_, 0, true);
  release_outside_shard(grads_, {0, total_});  // the pages shared by two layers' edges
  reduced_from_ = total_;
}

void ZeroSharding::finish() {
  finish_micro();
  if (comm_.size() == 1) return;
  const float inv = 1.0f / static_cast<float>(comm_.size());  // the float multiply, on the backend
  const Range g = grad_shard();
  if (g.end > g.begin) backend_.scale_inplace(grads_.view(g.begin, {g.end - g.begin}), inv);
}

void ZeroSharding::gather(int unit, PendingQueue& into) {
  for (const Range& r : units_[unit]) {
    shard_counts(r.begin, r.end, total_, comm_.size(), counts_);
    into.push_back({comm_.all_gather_v_async(params_.view(r.begin, {r.end - r.begin}), counts_), r});
  }
}

void ZeroSharding::use(int unit, bool backward) {
  if (stage_ != 3 || whole_) return;
  LOOM_CHECK(unit >= 0 && unit < static_cast<int>(units_.size()), "ZeRO-3: no parameter unit ", unit);
  if (!resident_[unit]) {
    if (gathering_[unit].empty()) gather(unit, gathering_[unit]);
    complete(gathering_[unit], 0, false);
    resident_[unit] = true;
  }
  // Prefetch: the unit the model uses next (blocks are units 1..L; unit 0 is used first).
  const int last = static_cast<int>(units_.size()) - 1;
  const int next = backward ? (unit == 0 ? last : unit - 1) : (unit == last ? 0 : unit + 1);
  if (next >= 1 && next != unit && !resident_[next] && gathering_[next].empty()) gather(next, gathering_[next]);
}

void ZeroSharding::done(int unit, bool) {
  if (stage_ != 3 || whole_) return;
  complete(gathering_[unit], 0, false);
  // Unit 0 is the last used in a pass: then no unit is resident and the whole complement of the
  // shard is released at once (so the pages shared by two units' edges go too).
  if (unit == 0) {
    release_outside_shard(params_, {0, total_});
  } else {
    for (const Range& r : units_[unit]) release_outside_shard(params_, r);
  }
  resident_[unit] = false;
}

void ZeroSharding::release_params() {
  if (stage_ != 3) return;
  for (size_t u = 0; u < units_.size(); ++u) complete(gathering_[u], 0, false);
  std::fill(resident_.begin(), resident_.end(), false);
  whole_ = false;
  release_outside_shard(params_, {0, total_});
}

}  // namespace loom
