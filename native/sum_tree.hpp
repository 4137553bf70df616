// Sum tree and min tree over a fixed number of leaves, for prioritized replay.
//
// Plain C++ with no Python headers: the bindings validate input, release the GIL and call
// in here.
//
// Shape: a 4-ary tree. The four children of a node live together in one 64-byte Group
// (their four sums, then their four mins), so each level of a descent or an update costs
// one cache line, and a tree of 2^20 leaves is 10 levels deep instead of 20.
//
// Batches: every batched operation walks the tree level by level across the whole batch
// rather than one query at a time. The loads of one level are independent of each other,
// so the CPU keeps many cache misses in flight, where a per-query descent waits on each
// load before it can issue the next. The inner loops are branch-free: a branch on the
// direction taken is mispredicted half the time and each misprediction discards the loads
// in flight.
//
// Addressing: node (l, j) is the j-th node of level l (the root is (0, 0), the leaves are
// level depth_). Node (l, j) has children (l+1, 4j .. 4j+3), stored in group
// first_group_[l] + j. Only nodes with at least one real leaf below them get a group;
// padding leaves (i >= capacity) and leaves never given a priority hold sum 0 and min
// +inf, so they are never found and never count towards the minimum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace apex {

class SumTree {
 public:
  explicit SumTree(int64_t capacity) : capacity_(capacity) {
    if (capacity < 1) throw std::invalid_argument("SumTree capacity must be >= 1");
    int64_t leaves = 4;
    depth_ = 1;
    while (leaves < capacity) {
      leaves *= 4;
      ++depth_;
    }
    // Level l has ceil(capacity / 4^(depth - l)) nodes with a real leaf below them.
    int64_t groups = 0;
    for (int l = 0; l < depth_; ++l) {
      first_group_.push_back(groups);
      const int64_t span = leaves >> (2 * l);  // leaves below one node of level l
      groups += (capacity + span - 1) / span;
    }
    Group empty;
    std::fill(empty.sum, empty.sum + 4, 0.0);
    std::fill(empty.min, empty.min + 4, std::numeric_limits<double>::infinity());
    group_.assign(static_cast<size_t>(groups), empty);
  }

  int64_t capacity() const { return capacity_; }
  double total() const {
    const Group& g = group_[0];
    return ((g.sum[0] + g.sum[1]) + g.sum[2]) + g.sum[3];  // the order descents use
  }
  double min() const {
    const Group& g = group_[0];
    return std::min(std::min(g.min[0], g.min[1]), std::min(g.min[2], g.min[3]));
  }
  size_t nbytes() const { return group_.size() * sizeof(Group); }

  // Sets leaf idx[i] to prio[i]. Inputs must already be valid (0 <= idx < capacity,
  // prio finite and >= 0). Repeated indices: the last one wins, because leaves are
  // written in order and parents are recomputed from their children afterwards.
  void update(const int64_t* idx, const double* prio, int64_t n) {
    for (int64_t i = 0; i < n; ++i) set_leaf(idx[i], prio[i], prio[i]);
    propagate(idx, n);
  }

  // Returns leaves to their never-set state (sum 0, min +inf): never found, and no longer
  // part of the minimum. For entries evicted from a replay.
  void clear(const int64_t* idx, int64_t n) {
    for (int64_t i = 0; i < n; ++i) set_leaf(idx[i], 0.0, std::numeric_limits<double>::infinity());
    propagate(idx, n);
  }

  // For each value v (0 <= v <= total, total > 0) finds the leaf i with
  // cumsum[i-1] <= v < cumsum[i]; v == total gives the last leaf with a positive priority.
  // The descent only ever enters a subtree whose sum is positive, so a leaf holding 0 is
  // never returned, even when rounding leaves v a hair above a subtree's sum.
  void find_prefixsum(const double* values, int64_t* out, int64_t n) const {
    std::vector<double> remaining(values, values + n);
    std::fill(out, out + n, int64_t{0});
    for (int l = 0; l < depth_; ++l) {
      const Group* level = group_.data() + first_group_[l];
      for (int64_t i = 0; i < n; ++i) {
        const Group& g = level[out[i]];
        const double v = remaining[i];
        const double prefix[4] = {0.0, g.sum[0], g.sum[0] + g.sum[1],
                                  (g.sum[0] + g.sum[1]) + g.sum[2]};
        // Step past prefix m only if child m or a later one has a positive sum, so the
        // descent never enters an empty subtree (v may exceed a sum by a rounding error).
        // A zero child in the middle is never chosen: v passes the next prefix too.
        const int64_t after3 = g.sum[3] > 0.0;
        const int64_t after2 = after3 | int64_t{g.sum[2] > 0.0};
        const int64_t after1 = after2 | int64_t{g.sum[1] > 0.0};
        const int64_t child = (int64_t{v >= prefix[1]} & after1) +
                              (int64_t{v >= prefix[2]} & after2) +
                              (int64_t{v >= prefix[3]} & after3);
        remaining[i] = v - prefix[child];
        out[i] = 4 * out[i] + child;
      }
    }
  }

  // Stratified sampling: uniforms[i] in [0, 1) picks a point in the i-th of n equal
  // slices of [0, total). Writes leaf indices and their priorities. Requires total > 0.
  void sample(const double* uniforms, int64_t* out_idx, double* out_prio, int64_t n) const {
    const double total = this->total();
    const double segment = total / static_cast<double>(n);
    std::vector<double> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      values[i] = std::min((static_cast<double>(i) + uniforms[i]) * segment, total);
    }
    find_prefixsum(values.data(), out_idx, n);
    get(out_idx, out_prio, n);
  }

  void get(const int64_t* idx, double* out, int64_t n) const {
    const Group* leaves = group_.data() + first_group_[depth_ - 1];
    for (int64_t i = 0; i < n; ++i) out[i] = leaves[idx[i] >> 2].sum[idx[i] & 3];
  }

 private:
  void set_leaf(int64_t i, double sum, double min) {
    Group& g = group_[first_group_[depth_ - 1] + (i >> 2)];
    g.sum[i & 3] = sum;
    g.min[i & 3] = min;
  }

  // Level by level towards the root: node (l, j) = sum/min of its group, written into
  // slot j % 4 of its parent's group.
  void propagate(const int64_t* idx, int64_t n) {
    std::vector<int64_t> path(idx, idx + n);  // each leaf's ancestor j at this level
    for (int l = depth_ - 1; l > 0; --l) {
      int64_t previous = -1;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = path[i] >> 2;
        path[i] = j;
        if (j == previous) continue;  // sorted or ring-buffer updates share parents
        previous = j;
        const Group& g = group_[first_group_[l] + j];
        Group& parent = group_[first_group_[l - 1] + (j >> 2)];
        parent.sum[j & 3] = ((g.sum[0] + g.sum[1]) + g.sum[2]) + g.sum[3];
        parent.min[j & 3] = std::min(std::min(g.min[0], g.min[1]), std::min(g.min[2], g.min[3]));
      }
    }
  }

  struct alignas(64) Group {
    double sum[4];
    double min[4];
  };

  int64_t capacity_;
  int depth_ = 1;                     // levels below the root; leaves are level depth_
  std::vector<int64_t> first_group_;  // per level l < depth_: group of node (l, 0)
  std::vector<Group> group_;
};

}  // namespace apex
