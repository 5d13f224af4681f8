// Ownership of flat elements: which elements of a flat buffer (parameters, gradients, optimizer
// state) a rank holds, updates or contributes. A RangeSet is a sorted list of disjoint,
// non-adjacent half-open ranges [begin, end); every operation returns a normalised set.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace loom {

struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

class RangeSet {
 public:
  RangeSet() = default;
  RangeSet(std::initializer_list<Range> ranges);
  explicit RangeSet(std::vector<Range> ranges);  // any order, may overlap or touch: normalised
  static RangeSet span(int64_t begin, int64_t end) { return RangeSet{{begin, end}}; }

  RangeSet intersect(const RangeSet& other) const;
  RangeSet subtract(const RangeSet& other) const;
  RangeSet unite(const RangeSet& other) const;
  // Positions [begin, end) of the concatenation of this set's ranges, as flat ranges (e.g. a
  // ZeRO shard of a pipeline rank's domain).
  RangeSet pieces(int64_t begin, int64_t end) const;

  int64_t size() const;  // elements covered
  bool empty() const { return ranges_.empty(); }
  const std::vector<Range>& ranges() const { return ranges_; }
  std::vector<Range>::const_iterator begin() const { return ranges_.begin(); }
  std::vector<Range>::const_iterator end() const { return ranges_.end(); }
  bool operator==(const RangeSet&) const = default;

 private:
  std::vector<Range> ranges_;
};

}  // namespace loom
