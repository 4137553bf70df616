// Sum tree and min tree over a fixed number of leaves, for prioritized replay.
//
// Plain C++ with no Python headers: the bindings validate input, release the GIL and call
// in here. Every batched operation walks the tree level by level across the whole batch
// rather than one query at a time: the loads of one level are independent of each other,
// so the CPU keeps many cache misses in flight, where a per-query descent waits on each
// load before it can issue the next.
//
// Layout: one implicit binary tree of 2*P nodes, P = capacity rounded up to a power of
// two. Node 1 is the root, node k has children 2k and 2k+1, leaf i is node P+i. Each node
// holds its subtree's sum and min side by side, so an update touches one cache line per
// level instead of two (a learner step at 2^20 leaves: ~65 us instead of ~100 us).
// Padding leaves (i >= capacity) and leaves never given a priority hold sum 0 and min
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
    while (leaf_base_ < capacity) {
      leaf_base_ *= 2;
      ++depth_;
    }
    node_.assign(2 * leaf_base_, Node{0.0, std::numeric_limits<double>::infinity()});
  }

  int64_t capacity() const { return capacity_; }
  double total() const { return node_[1].sum; }
  double min() const { return node_[1].min; }
  size_t nbytes() const { return node_.size() * sizeof(Node); }

  // Sets leaf idx[i] to prio[i]. Inputs must already be valid (0 <= idx < capacity,
  // prio finite and >= 0). Repeated indices: the last one wins, because leaves are
  // written in order and parents are recomputed from their children afterwards.
  void update(const int64_t* idx, const double* prio, int64_t n) {
    std::vector<int64_t> path(static_cast<size_t>(n));  // each update's node at this level
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = leaf_base_ + idx[i];
      node_[k].sum = prio[i];
      node_[k].min = prio[i];
      path[i] = k;
    }
    for (int level = 0; level < depth_; ++level) {
      int64_t previous = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t k = path[i] >> 1;
        path[i] = k;
        if (k == previous) continue;  // sorted or ring-buffer inserts share parents
        previous = k;
        const Node& a = node_[2 * k];
        const Node& b = node_[2 * k + 1];
        node_[k].sum = a.sum + b.sum;
        node_[k].min = std::min(a.min, b.min);
      }
    }
  }

  // For each value v (0 <= v <= total, total > 0) finds the leaf i with
  // cumsum[i-1] <= v < cumsum[i]; v == total gives the last leaf with a positive priority.
  // The descent only ever enters a subtree whose sum is positive, so a leaf holding 0 is
  // never returned, even when rounding leaves v a hair above the right subtree's sum.
  void find_prefixsum(const double* values, int64_t* out, int64_t n) const {
    std::vector<double> remaining(values, values + n);
    std::fill(out, out + n, int64_t{1});
    for (int level = 0; level < depth_; ++level) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t left = 2 * out[i];
        const double left_sum = node_[left].sum;
        const int64_t go_right = (remaining[i] >= left_sum) & (node_[left + 1].sum > 0.0);
        // Multiply, not `?:`: a branch here is mispredicted half the time, and every
        // misprediction throws away the loads in flight.
        remaining[i] -= left_sum * static_cast<double>(go_right);
        out[i] = left + go_right;
      }
    }
    for (int64_t i = 0; i < n; ++i) out[i] -= leaf_base_;
  }

  // Stratified sampling: uniforms[i] in [0, 1) picks a point in the i-th of n equal
  // slices of [0, total). Writes leaf indices and their priorities. Requires total > 0.
  void sample(const double* uniforms, int64_t* out_idx, double* out_prio, int64_t n) const {
    const double total = node_[1].sum;
    const double segment = total / static_cast<double>(n);
    std::vector<double> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      values[i] = std::min((static_cast<double>(i) + uniforms[i]) * segment, total);
    }
    find_prefixsum(values.data(), out_idx, n);
    get(out_idx, out_prio, n);
  }

  void get(const int64_t* idx, double* out, int64_t n) const {
    for (int64_t i = 0; i < n; ++i) out[i] = node_[leaf_base_ + idx[i]].sum;
  }

 private:
  struct Node {
    double sum;
    double min;
  };

  int64_t capacity_;
  int64_t leaf_base_ = 1;  // P: index of leaf 0
  int depth_ = 0;          // levels between the root and the leaves
  std::vector<Node> node_;
};

}  // namespace apex
