#include "loom/core/range_set.h"

#include <algorithm>

namespace loom {

RangeSet::RangeSet(std::initializer_list<Range> ranges) : RangeSet(std::vector<Range>(ranges)) {}

RangeSet::RangeSet(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (const Range& r : ranges) {
    if (r.begin >= r.end) continue;
    if (!ranges_.empty() && r.begin <= ranges_.back().end) ranges_.back().end = std::max(ranges_.back().end, r.end);
    else ranges_.push_back(r);
  }
}

RangeSet RangeSet::intersect(const RangeSet& other) const {
  std::vector<Range> out;
  size_t j = 0;
  for (const Range& a : ranges_) {
    while (j < other.ranges_.size() && other.ranges_[j].end <= a.begin) ++j;
    for (size_t k = j; k < other.ranges_.size() && other.ranges_[k].begin < a.end; ++k) {
      const int64_t lo = std::max(a.begin, other.ranges_[k].begin), hi = std::min(a.end, other.ranges_[k].end);
      if (lo < hi) out.push_back({lo, hi});
    }
  }
  return RangeSet(std::move(out));
}

RangeSet RangeSet::subtract(const RangeSet& other) const {
  std::vector<Range> out;
  for (const Range& a : ranges_) {
    int64_t at = a.begin;
    for (const Range& b : other.ranges_) {
      if (b.end <= at || b.begin >= a.end) continue;
      if (b.begin > at) out.push_back({at, b.begin});
      at = std::max(at, b.end);
    }
    if (at < a.end) out.push_back({at, a.end});
  }
  return RangeSet(std::move(out));
}

RangeSet RangeSet::unite(const RangeSet& other) const {
  std::vector<Range> all = ranges_;
  all.insert(all.end(), other.ranges_.begin(), other.ranges_.end());
  return RangeSet(std::move(all));
}

RangeSet RangeSet::pieces(int64_t begin, int64_t end) const {
  std::vector<Range> out;
  int64_t at = 0;  // position of the current range's first element in the concatenation
  for (const Range& r : ranges_) {
    const int64_t lo = std::max(begin, at), hi = std::min(end, at + r.size());
    if (lo < hi) out.push_back({r.begin + lo - at, r.begin + hi - at});
    at += r.size();
  }
  return RangeSet(std::move(out));
}

int64_t RangeSet::size() const {
  int64_t n = 0;
  for (const Range& r : ranges_) n += r.size();
  return n;
}

}  // namespace loom
